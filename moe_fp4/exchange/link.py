"""Which kind of link an expert-parallel group's exchanges cross: what fp4's default wire recipe follows.

The bytes an exchange saves pay only where the link is slow. Within one host whose GPUs reach each other
directly (NVLink, PCIe peer-to-peer) the exchange is a small part of the step and MXFP4's conversions cost about
what its bytes save, the summed streams in FP8 least; where NCCL goes through host memory or a network the
exchange is a large part of the step and the most compressed recipe is the fastest (docs/DESIGN.md, section 4,
"fp4's default follows the link"). So :data:`moe_fp4.exchange.recipes.LINK_RECIPE` gives fp4 a different
default per :class:`Link`, and :func:`detect_link` tells them apart.
"""

from __future__ import annotations

import os
import socket
from enum import Enum

import torch.distributed as dist

from moe_fp4.exchange.a2a import resolve_group


class Link(str, Enum):
    """The link between the ranks of an expert-parallel group."""

    PEER = "peer"        # one host, NCCL's peer-to-peer path on: NVLink or PCIe between the GPUs
    NETWORK = "network"  # the group spans hosts, or peer-to-peer is off (NCCL through host memory)


# NCCL settings that take its peer-to-peer path away (NCCL's documentation: NCCL_P2P_DISABLE=1, or
# NCCL_P2P_LEVEL=LOC / 0, "never use P2P"); `moe-fp4 compare --slow-link` sets the first.
_P2P_OFF = {"NCCL_P2P_DISABLE": ("1", "true", "yes", "on"), "NCCL_P2P_LEVEL": ("loc", "0")}


def p2p_disabled(environ=None) -> bool:
    """Whether this process's NCCL settings turn its peer-to-peer path off."""
    env = os.environ if environ is None else environ
    return any(env.get(name, "").strip().lower() in values for name, values in _P2P_OFF.items())


def host_id() -> str:
    """This machine's identity: the kernel's boot id where Linux gives one (the same for every container on
    one host, which share its GPUs' links), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        if boot:
            return boot
    except OSError:
        pass
    return socket.gethostname()


def link_of(hosts: list[str], p2p_off: list[bool]) -> Link:
    """Each rank's host id and whether its peer-to-peer path is off -> the group's :class:`Link`: NETWORK
    when the ranks sit on more than one host or any rank has peer-to-peer off, PEER otherwise."""
    if not hosts or len(hosts) != len(p2p_off):
        raise ValueError(f"link_of: one host id and one p2p flag per rank, got {len(hosts)} and {len(p2p_off)}")
    return Link.NETWORK if len(set(hosts)) > 1 or any(p2p_off) else Link.PEER


def detect_link(group=None) -> Link:
    """The :class:`Link` of ``group`` (None: the default group; whatever :func:`resolve_group` takes).

    A collective (one ``all_gather_object`` of each rank's host id and NCCL peer-to-peer setting over the
    group): every rank of the group must call it at the same point, as the MoE layer's first forward does.
    Needs an initialized process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("detect_link: torch.distributed is not initialized; call init_process_group first, "
                           "or give the link (EPConfig(link='peer' | 'network'))")
    g = resolve_group(group)
    mine = (host_id(), p2p_disabled())
    everyone: list = [None] * dist.get_world_size(g)
    dist.all_gather_object(everyone, mine, group=g)
    return link_of([h for h, _ in everyone], [off for _, off in everyone])


__all__ = ["Link", "detect_link", "host_id", "link_of", "p2p_disabled"]
