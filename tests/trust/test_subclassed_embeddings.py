"""Subclasses of ``nn.Embedding`` with a forward of their own, as BART's scaled token table and BART's, OPT's and
Whisper's position tables are, in a real fit at the defaults. Before, a position table whose module returns its
rows was left out (41% coverage here: a partial-coverage recommendation), and a token table held by two subclasses
and a tied head (BART's) was left out as "shared by several modules"."""

import pytest

from tests.trust.models import SubclassedEmbeddings
from tests.trust.setups import assert_fit_measures_whole


@pytest.mark.parametrize("counted, two_towers, tied_head", [("expand", True, True), ("mask", False, False),
                                                          ("slice", False, False)], ids=["BART", "OPT", "Whisper"])
def test_subclassed_embeddings_are_measured_whole(digits, exact_gns, tmp_path, counted, two_towers, tied_head):
    x, y = digits
    assert_fit_measures_whole(lambda: SubclassedEmbeddings(counted, two_towers, tied_head), (x * 16).round().long(),
                              y, exact_gns, tmp_path)
