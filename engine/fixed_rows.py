"""In-network groups' hooks on fixed row masks, for a decode step recorded once (``backbone.graph_decode``).

The eager decode attaches each in-network group's hooks for every forward pass, on the cache rows its live batch
rows hold at that step (an index tensor whose size changes as rows part and finish). A recorded step cannot: a CUDA
graph replays fixed shapes and addresses. So a runner made for a set of in-network groups holds ``FixedRowHooks``:
each group's hooks attached once on a bool **row mask** (one entry per runner row, on the device: the hooks compute
every row and keep the masked rows' results, ``plugins.network.rows_apply``), put on the backbone for the runner's
forward passes only (``on`` / ``off``, the recorded one included). Between steps the decode writes each group's
mask in place (``set_rows``: a copy into the same buffer, only when its rows changed), so the recorded step reads
the new rows. The runner, its hooks and their products (folded weights, derived constants) stay together in the
runner pool under ``hooks_key``: the plug-ins, their weights' identity and versions, their settings and whether
traces are recorded — a plug-in trained further, or another setting, makes another key.
"""
from __future__ import annotations

import torch

from backbone.torch_internals import version


def fixed_rows_refusal(batch) -> str | None:
    """Why the in-network groups of ``batch`` cannot run on fixed row masks (None: they can)."""
    for grp in batch.net:
        if not getattr(grp.plugin, "fixed_rows", False):
            return f"the in-network plug-in {grp.plugin.method!r} has no fixed-row hooks"
    return None


def _weights_stamp(plugin) -> tuple:
    """Which tensors the plug-in holds and their versions: a change (training, ``load_state_dict``, ``.to()``)
    makes another key, so no recorded step reads products derived from older weights."""
    out = []
    for t in (*plugin.parameters(), *plugin.buffers()):
        try:
            v = version(t)
        except RuntimeError:  # an inference tensor: no version counter, and no change in place outside it
            v = -1
        out.append((t.data_ptr(), v))
    return tuple(out)


def hooks_key(batch, trace: bool) -> tuple:
    """The pool key of ``batch``'s in-network groups' hooks (in the batch's group order)."""
    return tuple((id(grp.plugin), grp.key, _weights_stamp(grp.plugin)) for grp in batch.net) + (bool(trace),)


class FixedRowHooks:
    """Every in-network group's hooks of a runner of ``rows`` rows, each on its own device row mask."""

    def __init__(self, groups, rows: int, device, trace: bool):
        self.rows = rows
        self.masks = [torch.zeros(rows, dtype=torch.bool, device=device) for _ in groups]
        self._host = [[False] * rows for _ in groups]
        self.attached: list[tuple] = []  # (plug-in, handles), suspended between forward passes
        try:
            for grp, mask in zip(groups, self.masks):
                handles = grp.plugin.attach(mask, grp.settings, trace=trace)
                self.attached.append((grp.plugin, handles))
                if not grp.plugin.suspend(handles):
                    raise RuntimeError(f"the hooks of {grp.plugin.method!r} cannot be taken off and put back")
        except Exception:
            self.close()
            raise

    def handles(self, g: int) -> list:
        """Group ``g``'s attachment handles (what ``network_trace`` reads after a step)."""
        return self.attached[g][1]

    def on(self) -> None:
        for plugin, handles in self.attached:
            if not plugin.resume(handles):
                raise RuntimeError(f"the hooks of {plugin.method!r} could not be put back")

    def off(self) -> None:
        for plugin, handles in self.attached:
            plugin.suspend(handles)

    def set_rows(self, g: int, rows: list[int]) -> None:
        """Group ``g``'s hooks act on runner rows ``rows`` from the next step on (the mask written in place)."""
        want = [False] * self.rows
        for r in rows:
            want[r] = True
        if want != self._host[g]:
            self.masks[g].copy_(torch.tensor(want, dtype=torch.bool))
            self._host[g] = want

    def close(self) -> None:
        for _, handles in self.attached:
            for h in handles:
                h.remove()
        self.attached = []
