"""``benchmarks/broadcast_cost.py`` runs and times what it says: the tracker measuring the ViT's bare parameters
(whole coverage) against one leaving them out."""

from benchmarks import broadcast_cost


def test_one_step_of_each_measures_whole_and_partial_coverage():
    table = broadcast_cost.run(steps=1)
    assert "coverage 100.0%" in table.splitlines()[2] and "coverage 97.0%" in table.splitlines()[2]
