"""Token tables of the model's own code (``F.embedding(tokens, W)``, ``V[tokens]``) in a real fit at the defaults.
Before, both were left out (here 5% of the parameters: their lookups' outputs are no broadcast, so no per-example
gradient was read), and the estimate was the head's alone."""

from tests.trust.models import BareTokenTables
from tests.trust.setups import assert_fit_measures_whole


def test_bare_token_tables_are_measured_whole(digits, exact_gns, tmp_path):
    x, y = digits
    assert_fit_measures_whole(BareTokenTables, (x * 16).round().long(), y, exact_gns, tmp_path)
