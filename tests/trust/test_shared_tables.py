"""Several embeddings holding one table (T5's ``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens``), in a
real fit at the defaults, with both lookups called, with one never called (``T5EncoderModel``), and with the output
layer tied to the table too (BART, T5 v1.0). Before, the table was left out (here 38% of the parameters: no batch
was recommended)."""

from functools import partial

import pytest

from tests.trust.models import SharedTables
from tests.trust.setups import assert_fit_measures_whole


@pytest.mark.parametrize("decoder_tokens, tied_head", [(8, False), (0, False), (8, True)],
                         ids=["both lookups", "one never called", "a tied head too"])
def test_one_micro_batch_per_step_measures_a_table_shared_by_several_embeddings(digits, exact_gns, tmp_path,
                                                                                 decoder_tokens, tied_head):
    x, y = digits
    assert_fit_measures_whole(partial(SharedTables, decoder_tokens, tied_head=tied_head), (x * 16).round().long(), y,
                              exact_gns, tmp_path)
