"""Several embeddings holding one table (T5's ``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens``), in a
real fit at the defaults, with both lookups called and with one never called (``T5EncoderModel``). Before, the table
was left out (here 38% of the parameters: no batch was recommended)."""

from functools import partial

import pytest

from tests.trust.models import SharedTables
from tests.trust.setups import assert_fit_measures_whole


@pytest.mark.parametrize("decoder_tokens", [8, 0], ids=["both lookups", "one never called"])
def test_one_micro_batch_per_step_measures_a_table_shared_by_several_embeddings(digits, exact_gns, tmp_path,
                                                                                 decoder_tokens):
    x, y = digits
    assert_fit_measures_whole(partial(SharedTables, decoder_tokens), (x * 16).round().long(), y, exact_gns, tmp_path)
