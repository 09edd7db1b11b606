"""Which link an expert-parallel group crosses (moe_fp4.exchange.link) and the default recipes that follow it
(moe_fp4.exchange.recipes.LINK_RECIPE, EPConfig.link / wire_link). The detection over real ranks, and the
formats each link's default puts on the wire, are checked on gloo in test_ep.py
(test_ep_fp4_default_follows_the_link, worlds 2 and 4, subgroups at 4)."""

import pytest
import torch.distributed as dist

from moe_fp4.compare.report import wire_text
from moe_fp4.exchange.ep import EPConfig
from moe_fp4.exchange.link import Link, detect_link, host_id, link_of, p2p_disabled
from moe_fp4.exchange.recipes import (
    LINK_RECIPE,
    PRECISION_RECIPE,
    RECIPES,
    default_recipe,
    default_recipe_name,
    follows_link,
)


def test_link_of_the_ranks():
    assert link_of(["a"], [False]) is Link.PEER
    assert link_of(["a", "a", "a", "a"], [False] * 4) is Link.PEER
    assert link_of(["a", "a", "b", "b"], [False] * 4) is Link.NETWORK       # two hosts
    assert link_of(["a", "a"], [False, True]) is Link.NETWORK               # one rank without peer-to-peer
    with pytest.raises(ValueError, match="one host id and one p2p flag per rank"):
        link_of(["a", "b"], [False])
    with pytest.raises(ValueError, match="one host id"):
        link_of([], [])


@pytest.mark.parametrize("env, off", [
    ({}, False), ({"NCCL_P2P_DISABLE": "1"}, True), ({"NCCL_P2P_DISABLE": "0"}, False),
    ({"NCCL_P2P_DISABLE": " TRUE "}, True), ({"NCCL_P2P_LEVEL": "LOC"}, True), ({"NCCL_P2P_LEVEL": "0"}, True),
    ({"NCCL_P2P_LEVEL": "NVL"}, False), ({"NCCL_P2P_LEVEL": "SYS"}, False),
])
def test_p2p_disabled_reads_nccls_settings(env, off):
    assert p2p_disabled(env) is off


def test_host_id_is_stable():
    assert host_id() and host_id() == host_id()


def test_detect_link_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        detect_link()


def test_defaults_per_link():
    assert set(LINK_RECIPE) == {k.value for k in Link}
    for defaults in LINK_RECIPE.values():
        assert set(defaults) == {"bf16", "fp8", "fp4"} and all(n in RECIPES for n in defaults.values())
    # fp4: the summed streams in FP8 within a peer-to-peer host, every exchange in 4 bits where bytes pay.
    assert default_recipe_name("fp4", Link.PEER) == "fp4-fp8sums"
    assert default_recipe_name("fp4", "network") == "fp4-all"
    assert default_recipe("fp4", Link.NETWORK) is RECIPES["fp4-all"]
    # bf16 and fp8 send the same on every link; without a link, the peer defaults.
    for p in ("bf16", "fp8"):
        assert not follows_link(p) and default_recipe_name(p, "peer") == default_recipe_name(p, "network")
    assert follows_link("fp4")
    assert PRECISION_RECIPE == LINK_RECIPE["peer"] and default_recipe("fp4") is RECIPES["fp4-fp8sums"]
    with pytest.raises(ValueError, match="no default wire recipes for link 'ib'"):
        default_recipe("fp4", "ib")


def test_epconfig_link():
    # Given: no detection, no process group needed.
    assert EPConfig(link="network").wire("fp4") == RECIPES["fp4-all"]
    assert EPConfig(link=Link.PEER).wire("fp4") == RECIPES["fp4-fp8sums"]
    assert EPConfig(link="network").wire_link() is Link.NETWORK
    # A simulated wire crosses no link: the peer defaults, unless a link is given.
    assert EPConfig(simulate=True).wire_link() is Link.PEER
    assert EPConfig(simulate=True).wire("fp4") == RECIPES["fp4-fp8sums"]
    assert EPConfig(simulate=True, link="network").wire("fp4") == RECIPES["fp4-all"]
    # A precision whose formats do not depend on the link never detects (no process group here).
    assert EPConfig().wire("fp8") == RECIPES["fp8"] and EPConfig().wire("bf16") == RECIPES["bf16"]
    assert not EPConfig().follows_link("fp8") and EPConfig().follows_link("fp4")
    # A recipe, or all four roles, pins fp4's formats: nothing to detect.
    assert EPConfig(recipe="fp4-sr").wire("fp4") == RECIPES["fp4-sr"]
    assert not EPConfig(recipe={"fp4": "fp4-fp8sums"}).follows_link("fp4")
    pinned = EPConfig(dispatch="mxfp4", combine="bf16", dispatch_grad="bf16", combine_grad="mxfp4-sr")
    assert not pinned.follows_link("fp4") and pinned.wire("fp4") == RECIPES["fp4-sr"]
    # A role override applies on either link.
    assert EPConfig(link="network", combine="fp8").wire("fp4") == RECIPES["fp4-all"].with_(combine="fp8")
    # fp4's default with neither a link nor a process group: the detection says what is missing.
    with pytest.raises(RuntimeError, match="give the link"):
        EPConfig().wire("fp4")
    with pytest.raises(ValueError, match="EPConfig.link: one of peer, network"):
        EPConfig(link="nvlink")
    for bad in (EPConfig().wire, EPConfig().follows_link):
        with pytest.raises(ValueError, match="no precision 'int8'"):
            bad("int8")


def test_compare_names_the_default_and_its_link():
    roles = RECIPES["fp4-all"].as_dict()
    wire = {"recipe": None, "per_mode": {"fp4": roles, "fp8": RECIPES["fp8"].as_dict()}, "simulated": False,
            "link": "network"}
    assert wire_text(wire, "fp4") == ("recipe fp4-all: dispatch mxfp4, combine mxfp4, dispatch_grad mxfp4-sr, "
                                      "combine_grad mxfp4-sr (fp4's default on a network link)")
    # fp8's default is the same on every link: nothing to say.
    assert wire_text(wire, "fp8") == "recipe fp8: dispatch fp8, combine bf16, dispatch_grad bf16, combine_grad fp8"
    # A recipe the user chose is not called a default.
    assert not wire_text({**wire, "recipe": {"fp4": "fp4-all"}}, "fp4").endswith("link)")
