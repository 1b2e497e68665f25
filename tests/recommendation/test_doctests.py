import doctest

import pytest

from gns_callback.recommendation import batch, core, current, rules, sizing, stability, tradeoff


@pytest.mark.parametrize("module", [rules, sizing, tradeoff, core, batch, current, stability], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
