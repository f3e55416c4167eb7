"""Neighbour maps: one output token of a comparison's kNN or PEMA row on its memory's 2-D map (the profile's
projection, ``memories.profile``), with the token's query and its nearest memory entries."""
from __future__ import annotations

import numpy as np
import torch

from ground.errors import UserError
from memories.profile import highlighted_target, project, scaled_keys
from memories.store import Memory
from plugins.card import NeighbourMap
from plugins.registry import neighbour_map_of
from studio.backbone_service import BackboneService
from studio.caches import LRU
from studio.compare_service import CompareService
from studio.context import StudioContext
from studio.memory_service import MemoryService
from studio.plugin_service import PluginService

QUERY_CACHE = 16        # per (comparison, row): the output tokens' f(c), recomputed once
MAP_NEIGHBOURS = 8      # neighbours on a map (kNN: at most what its decode traced)
SEARCH_CHUNK = 32768    # keys compared at once in the exact search of a map's neighbours


class NeighbourMapService:
    """Receives the context, the backbone (one teacher-forced pass per row), the memories (profiles, token names),
    the plug-ins (a row's query) and the comparisons (the owner's recent ones)."""

    def __init__(self, ctx: StudioContext, backbone_svc: BackboneService, memory_svc: MemoryService,
                 plugin_svc: PluginService, compare_svc: CompareService):
        self.ctx = ctx
        self.backbone_svc = backbone_svc
        self.memory_svc = memory_svc
        self.plugin_svc = plugin_svc
        self.compare_svc = compare_svc
        self.queries = LRU(QUERY_CACHE)

    def _output_states(self, p: dict, row: dict) -> np.ndarray:
        """f(c) before each of a row's output tokens (n × d, float32): one teacher-forced pass of the backbone over
        the comparison's context and the row's tokens, cached per (comparison, row). The decode computed the same
        states with a KV cache (equal up to float rounding)."""
        key = (p["id"], row["label"])
        hit = self.queries.get(key)
        if hit is not None:
            return hit
        ctx, toks = list(p["context_ids"]), list(row["tokens"])
        with self.backbone_svc.interactive("a neighbour map") as bb:
            with torch.no_grad():
                fc, _ = bb.forward_fc(torch.tensor([ctx + toks[:-1]], dtype=torch.long))
        start = len(ctx) - 1  # the position whose next token is the first output token
        return self.queries.put(key, fc[0, start:start + len(toks)].float().cpu().numpy())

    @staticmethod
    def _nearest(memory: Memory, queries: np.ndarray, k: int) -> np.ndarray:
        """For each query (n × d, scaled like the keys), the ``k`` entries whose scaled keys are nearest (squared
        L2 over every entry, one pass over the keys in chunks): (n × k) entry indices, nearest first. The caller
        recomputes the exact distances of what it shows."""
        q = np.atleast_2d(np.asarray(queries, dtype=np.float32))
        q_sq = (q ** 2).sum(1)[:, None]
        best_e, best_d = np.zeros((len(q), 0), np.int64), np.zeros((len(q), 0), np.float32)
        for b0 in range(0, len(memory), SEARCH_CHUNK):
            rows = np.arange(b0, min(len(memory), b0 + SEARCH_CHUNK))
            keys = scaled_keys(memory, rows)
            d = (keys ** 2).sum(1)[None, :] - 2 * q @ keys.T + q_sq
            e = np.concatenate([best_e, np.broadcast_to(rows, d.shape)], 1)
            d = np.concatenate([best_d, d], 1)
            keep = np.argsort(d, axis=1, kind="stable")[:, :k]
            best_e, best_d = np.take_along_axis(e, keep, 1), np.take_along_axis(d, keep, 1)
        return best_e

    def _map_queries(self, p: dict, row: dict, plugin, nmap: NeighbourMap, memory: Memory,
                     k: int) -> tuple[np.ndarray, np.ndarray]:
        """The map's query before each of a row's output tokens (``NeighbourMap.queries``, among the scaled keys) and
        each one's ``k`` nearest entries: one pass over the memory's keys for all the tokens, cached per
        (comparison, row, k) — picking another token then costs nothing."""
        key = (p["id"], row["label"], row["method"], k)
        hit = self.queries.get(key)
        if hit is not None:
            return hit
        h = nmap.queries(plugin, self._output_states(p, row), memory)
        return self.queries.put(key, (h, self._nearest(memory, h, k)))

    def neighbour_map(self, comparison_id: str, label: str, token_index: int, *, owner: str | None = None,
                      k: int = MAP_NEIGHBOURS) -> dict:
        """One output token of a kNN or PEMA row of the owner's comparison, on its memory's 2-D map (the profile's
        projection): the query — kNN: f(c) / key RMS; PEMA: h_pd = B_pd·A·(f(c) / key RMS), rescaled to the keys'
        RMS — and its ``k`` nearest memory entries, each with its value token marked inside its sample's target
        and its source. The profile's sampled keys come along as the map's background."""
        owner = self.ctx.owner(owner)
        p = self.compare_svc.recent(comparison_id, owner=owner)
        row = next((r for r in p["rows"] if r["label"] == label), None)
        if row is None:
            raise UserError(f"No output {label!r} in this comparison.")
        nmap = neighbour_map_of(row["method"])
        if nmap is None or not row.get("plugin_id"):
            raise UserError(f"The neighbour map is for kNN and PEMA rows; {label!r} is {row['method']}.")
        try:
            i = int(token_index)
            k = int(k)
        except (TypeError, ValueError):
            raise UserError("The output token and k must be whole numbers.") from None
        if not 0 <= i < len(row["tokens"]):
            raise UserError(f"{label!r} has {len(row['tokens'])} output token(s); token {i} does not exist.")
        if not 1 <= k <= 64:
            raise UserError("k (neighbours on the map) must be between 1 and 64.")
        bb = self.backbone_svc.loaded_backbone()
        if p.get("backbone") != (bb.name if bb is not None else None):
            raise UserError("This comparison was made on another backbone.")
        if self.backbone_svc.offsite():
            raise UserError("A neighbour map runs the decoder over the output again, and the model owner keeps the "
                            "decoder: not available with a remote backbone.")
        plugin = self.plugin_svc.load_plugin(row["plugin_id"], owner)
        memory = getattr(plugin, "memory", None)
        if memory is None:
            try:
                memory = self.memory_svc.load_memory(self.plugin_svc.plugin_row(row["plugin_id"], owner)["memory_id"],
                                                     owner)
            except UserError:
                raise UserError(f"The memory {label!r} was trained on has been deleted: no map.") from None
        if len(memory) == 0:
            raise UserError("The memory has no training entries to map.")
        prof = self.memory_svc.profile(memory)
        traced = (row["trace"][i].get("neighbours") or []) if i < len(row["trace"]) else []
        if nmap.traced_neighbours:  # the neighbours the decode retrieved (an exact search if it traced none)
            query = nmap.queries(plugin, self._output_states(p, row)[i:i + 1], memory)
            entries = [int(n["entry"]) for n in traced if n.get("entry") is not None][:k] \
                or [int(e) for e in self._nearest(memory, query, k)[0]]
        else:
            h, nearest = self._map_queries(p, row, plugin, nmap, memory, k)
            query, entries = h[i:i + 1], [int(e) for e in nearest[i]]
        keys = scaled_keys(memory, np.asarray(entries, dtype=np.int64))
        dist = ((keys - query) ** 2).sum(1)
        xy, q_xy = project(prof, keys), project(prof, query)[0]
        name, decode = self.memory_svc.token_namer(memory)
        decode_dist = {int(n["entry"]): n.get("distance") for n in traced if n.get("entry") is not None}
        out_tok = int(row["tokens"][i])
        nbs = []
        for rank, (e, d, (x_, y_)) in enumerate(zip(entries, dist.tolist(), xy.tolist())):
            h = highlighted_target(memory, e, decode, name)
            tid = int(memory.values[e])
            nbs.append({"rank": rank + 1, "entry": e, "token_id": tid, "token": name(tid),
                        "same_as_output": tid == out_tok, "distance": round(float(d), 4),
                        "decode_distance": decode_dist.get(e), "xy": [round(x_, 4), round(y_, 4)],
                        "source": memory.samples[h["sample"]].get("src") or "", **h})
        query_label, query_kind, neighbour_kind = nmap.kinds
        proj = prof["projection"]
        return {"comparison_id": p["id"], "label": label, "method": row["method"], "token_index": i,
                "token_id": out_tok, "token": name(out_tok), "memory_id": memory.id, "memory_name": prof["name"],
                "query_label": query_label, "query_kind": query_kind, "neighbour_kind": neighbour_kind,
                "query": [round(float(q_xy[0]), 4), round(float(q_xy[1]), 4)], "neighbours": nbs,
                "matching": sum(n["same_as_output"] for n in nbs),
                "projection": {"method": proj["method"], "explained": proj["explained"],
                               "points": proj["points"], "tokens": proj["tokens"]}}
