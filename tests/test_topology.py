"""The one topology table: presets, node map and topology resolution from hostnames."""
import pytest

from eb_deepspeed.core.topology import node_map, resolve_topology

pytestmark = pytest.mark.unit


def test_ranks_on_the_same_host_share_a_node_numbered_in_order_of_first_appearance():
    assert node_map(["b", "b", "a", "a"]) == [0, 0, 1, 1]
    assert node_map(["n1", "n2", "n1", "n2"]) == [0, 1, 0, 1]
    assert node_map(["solo"]) == [0]


@pytest.mark.parametrize("name, explicit, nodes, resolved, warns", [
    ("pcie", False, 1, "pcie", None),                      # one node: nothing to change
    ("pcie", False, 2, "multi_node", "was the default"),    # not set, two nodes: follow the ranks
    ("nvlink", True, 2, "nvlink", "priced at its one bandwidth"),      # set by the user: kept, with a warning
    ("multi_node", True, 3, "multi_node", None),
])
def test_a_topology_follows_the_nodes_unless_the_user_set_it(name, explicit, nodes, resolved, warns):
    got, warning = resolve_topology(name, explicit=explicit, num_nodes=nodes)
    assert got == resolved
    assert (warning is None) if warns is None else (warns in warning)

