"""A method's card: what the studio, the time estimate and the model card know of a method besides how it trains,
saves and decodes (``plugins.base.Plugin`` and the engine's protocols). Each method's module declares one beside its
class and registers both together (``@register(CARD)``, ``plugins.registry``); ``plugins.registry.method_card``
reads it back.

* ``TimeEstimate`` — read by ``plugins.estimate``: the short run it times, how long training takes from a measured
  record, and the record a finished run makes.
* ``NeighbourMap`` — read by the studio's neighbour map (Compare): what the query and its neighbours are, and where
  a row's query lies among the memory's keys.
* ``MethodCard`` — the paper (the model card, ``plugins.hub``, the methods list), the per-method tests' short run,
  both of the above, and the studio's and the model card's few per-method facts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np


def scaled_queries(plugin, fc: np.ndarray, memory) -> np.ndarray:
    """The neighbour map's default query: f(c) scaled like the memory's keys (what kNN searches with)."""
    return fc / np.float32(memory.key_scale)


@dataclass(frozen=True)
class TimeEstimate:
    """How ``plugins.estimate`` times a method and predicts its training time."""

    # The short run ``python -m plugins.estimate measure`` times (a few steps of every phase).
    measure_settings: dict
    # (method class, config, measured record, training samples, entries) → ``{"setup_s", "loops", "budget_text"}``
    # (loops: ``plugins.timing.loop``), or ``{"setup_s", "loops": [], "text"}`` for a method with nothing to train.
    training_time: Callable[..., dict]
    # (plug-in, info, history, wall seconds, memory or None) → the record ``training_time`` reads, from a finished
    # short run (``info``: ``train_info`` with the fit's metrics over it; ``wall_s``: the whole run's seconds).
    throughput_record: Callable[..., dict]


@dataclass(frozen=True)
class NeighbourMap:
    """The studio's neighbour map (Compare) of a method's rows."""

    # (the query's short label, what the query is, what its neighbours are)
    kinds: tuple[str, str, str]
    # (plug-in, fc: n × d float32 f(c) of a row's output tokens, memory) → each token's query, in the space of the
    # memory's keys divided by their RMS
    queries: Callable[..., np.ndarray] = scaled_queries
    traced_neighbours: bool = False  # the decode's trace names the neighbours (else: an exact search)


@dataclass(frozen=True)
class MethodCard:
    """What is known of a method besides its class (see the module docstring)."""

    paper: str
    estimate: TimeEstimate
    # A few steps of training on the tiny model: the per-method test suites' run (tests/test_methods.py).
    quick_settings: dict = field(default_factory=dict)
    neighbour_map: NeighbourMap | None = None  # None: no neighbour map for its rows
    # Where the studio needs one method's row of several (Compare's token views, the training form), this one first.
    shown_first: bool = False
    without_datastore_note: str = ""  # the model card's line when the package has no datastore ("" says nothing)
