"""Plotly figure builders: plain functions of plain data (lists/dicts from the service), testable without a browser.

Every builder returns a ``plotly.graph_objects.Figure``; with nothing to draw it returns :func:`empty` with a short
message instead of raising, so a view never breaks on a missing trace field.

One escaping rule for every figure (:func:`escape_figure`, applied by ``_layout``, which every builder ends with):
Plotly draws titles, legends, axis labels and tick labels, annotations, trace text and hover labels as a small HTML
dialect (links, styles, bold), and a user's text reaches all of them (memory, plug-in and share labels, tokens,
sentences). Every text in a figure is escaped (``&``, ``<``, ``>``), so it is drawn as the characters it is. Hover
templates are this module's own markup; a user's text reaches them only through ``%{…}`` fields (a trace's name,
its ``customdata``), which are escaped like the rest.
"""
from __future__ import annotations

import html

import numpy as np
import plotly.graph_objects as go

COLORS = ["#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#ca8a04", "#db2777"]
SOURCE_COLORS = {"P_LM": "#64748b", "plug-in": "#ea580c", "final": "#2563eb"}
FONT = dict(family="system-ui, -apple-system, Segoe UI, sans-serif", size=12)


# Plotly's own markup (``%{…}`` fields, <br>, <extra>): written here, never from a user's text
TEMPLATE_KEYS = {"hovertemplate", "texttemplate", "template", "hovertemplatefallback", "texttemplatefallback"}


def label(text) -> str:
    """A user's text as Plotly must be given it to draw it as is: ``&``, ``<`` and ``>`` as entities."""
    return html.escape("" if text is None else str(text), quote=False)


def _escaped(value, key: str = ""):
    if key in TEMPLATE_KEYS:
        return value
    if isinstance(value, str):
        return label(value)
    if isinstance(value, dict):
        return {k: _escaped(v, k) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return [_escaped(v) for v in value.tolist()] if value.dtype.kind in "OUS" else value
    if isinstance(value, (list, tuple)):
        return [_escaped(v) for v in value]
    return value


def escape_figure(fig: go.Figure) -> go.Figure:
    """Escape every text of ``fig`` in place (see the module's docstring): each trace's and the layout's strings,
    whatever property holds them; hover and text templates are left as written."""
    for trace in fig.data:
        props = {k: v for k, v in trace.to_plotly_json().items() if k not in ("type", "uid")}
        trace.update(_escaped(props), overwrite=True)
    layout = {k: v for k, v in fig.layout.to_plotly_json().items() if k != "template"}
    fig.layout.update(_escaped(layout), overwrite=True)
    return fig


def _layout(fig: go.Figure, title: str = "", height: int = 300, **kw) -> go.Figure:
    # The title sits at the top edge and the legend in its own line below it, so the two never overlap in a
    # narrow column.
    legend_line = title and len(fig.data) > 1
    fig.update_layout(title=dict(text=title, x=0.01, xanchor="left", y=0.985, yanchor="top", yref="container",
                                 font=dict(size=14)) if title else None,
                      template="plotly_white", height=height, font=FONT,
                      margin=dict(l=48, r=16, t=(64 if legend_line else 40) if title else 16, b=40),
                      legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1), **kw)
    return escape_figure(fig)


def empty(message: str = "Nothing to show yet", height: int = 300) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                       font=dict(size=13, color="#64748b"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, height=height)


def _tok(t: str) -> str:
    """A token for an axis label: visible whitespace, short."""
    t = str(t).replace("\n", "⏎").replace(" ", "·")
    return t if len(t) <= 14 else t[:13] + "…"


def _unique_labels(tokens: list[str]) -> list[str]:
    """Axis categories must be unique: number repeated tokens."""
    return [f"{i}:{_tok(t)}" for i, t in enumerate(tokens)]


# --- training ---------------------------------------------------------------------------------------------------
def loss_curve(history: list[dict], title: str = "Training loss") -> go.Figure:
    """Training loss per step, one line per phase, held-out loss as dashed markers."""
    if not history:
        return empty("The loss curve appears once training starts")
    fig = go.Figure()
    phases = list(dict.fromkeys(h.get("phase", "train") for h in history))
    for i, ph in enumerate(phases):
        pts = [h for h in history if h.get("phase", "train") == ph]
        tr = [h for h in pts if h.get("loss") is not None]
        ho = [h for h in pts if h.get("heldout_loss") is not None]
        c = COLORS[i % len(COLORS)]
        if tr:
            fig.add_trace(go.Scatter(x=[h.get("step", j) for j, h in enumerate(tr)], y=[h["loss"] for h in tr],
                                     mode="lines", name=f"{ph} (train)", line=dict(color=c, width=2)))
        if ho:
            fig.add_trace(go.Scatter(x=[h.get("step", j) for j, h in enumerate(ho)],
                                     y=[h["heldout_loss"] for h in ho], mode="lines+markers",
                                     name=f"{ph} (held-out)", line=dict(color=c, dash="dash", width=1.5)))
    if not fig.data:
        return empty("No loss values reported yet")
    fig.update_xaxes(title_text="step (per phase)")
    if _wide_range(fig):
        fig.update_yaxes(title_text="loss (log)", type="log", dtick=1)
    else:
        fig.update_yaxes(title_text="loss")
    return _layout(fig, title)


def _wide_range(fig: go.Figure) -> bool:
    ys = [y for tr in fig.data for y in (tr.y or []) if y is not None and y > 0]
    return bool(ys) and max(ys) / max(min(ys), 1e-12) > 50


# --- token-level views -------------------------------------------------------------------------------------------
def lambda_curve(rows: list[dict], selected: tuple[str, int] | None = None,
                 title: str = "λ_t over output tokens") -> go.Figure:
    """λ_t (the plug-in's mixing weight) per output token for every row whose trace reports one."""
    fig = go.Figure()
    for i, r in enumerate(rows):
        lams = [t.get("lambda") for t in r.get("trace", [])]
        if not any(v is not None for v in lams):
            continue
        c = COLORS[i % len(COLORS)]
        toks = r.get("token_texts") or [t.get("text", "") for t in r["trace"]]
        fig.add_trace(go.Scatter(x=list(range(len(lams))), y=lams, mode="lines+markers", name=r["label"],
                                 line=dict(color=c, width=2, shape="hv"), marker=dict(size=6),
                                 customdata=[_tok(t) for t in toks[:len(lams)]],
                                 hovertemplate="token %{x} %{customdata}<br>λ=%{y:.3f}"
                                               "<extra>%{fullData.name}</extra>"))
        if selected and selected[0] == r["label"] and 0 <= selected[1] < len(lams) and lams[selected[1]] is not None:
            fig.add_trace(go.Scatter(x=[selected[1]], y=[lams[selected[1]]], mode="markers", showlegend=False,
                                     marker=dict(size=14, color="rgba(0,0,0,0)", line=dict(color=c, width=3)),
                                     hoverinfo="skip"))
    if not fig.data:
        return empty("No method with a mixing weight λ (PEMA, kNN) in this comparison")
    fig.update_xaxes(title_text="output token", dtick=1 if max(len(t.x) for t in fig.data) <= 30 else None)
    fig.update_yaxes(title_text="λ_t", range=[-0.03, 1.03])
    return _layout(fig, title)


def token_bars(entry: dict | None, title: str = "") -> go.Figure:
    """P_LM vs plug-in vs final: the top tokens of each distribution for one output token (grouped bars)."""
    if not entry:
        return empty("Pick an output token")
    groups = [("P_LM", entry.get("top_lm")), ("plug-in", entry.get("top_plugin")), ("final", entry.get("top_final"))]
    groups = [(n, g) for n, g in groups if g]
    if not groups:
        return empty("This token has no distributions in its trace")
    order: list[str] = []
    for _, g in groups:
        for _, text, _ in g:
            if _tok(text) not in order:
                order.append(_tok(text))
    fig = go.Figure()
    for name, g in groups:
        probs = {_tok(text): p for _, text, p in g}
        fig.add_trace(go.Bar(x=order, y=[probs.get(t, 0.0) for t in order], name=name,
                             marker_color=SOURCE_COLORS[name],
                             hovertemplate="%{x}: %{y:.3f}<extra>%{fullData.name}</extra>"))
    chosen = _tok(entry.get("text", ""))
    t = title or f"Top tokens at “{chosen}”" + (f" (λ={entry['lambda']:.2f})" if entry.get("lambda") is not None
                                                  else "")
    fig.update_layout(barmode="group")
    top = max((p for _, g in groups for _, _, p in g), default=1.0)
    fig.update_yaxes(title_text="probability", range=[0, min(1.02, max(0.05, top * 1.15))])
    return _layout(fig, t)


def neighbour_bars(neighbours: list[dict], title: str = "kNN neighbours") -> go.Figure:
    """Distances of the retrieved entries (shorter bar = closer), labelled with their value token."""
    if not neighbours:
        return empty("No kNN neighbours for this token")
    labels = [f"{i + 1}. {_tok(n.get('token', ''))}" for i, n in enumerate(neighbours)]
    fig = go.Figure(go.Bar(x=[n.get("distance", 0) for n in neighbours], y=labels, orientation="h",
                           marker_color=COLORS[0], hovertemplate="%{y}: distance %{x:.3f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="squared L2 distance (scaled keys)")
    return _layout(fig, title, height=max(220, 28 * len(neighbours) + 80))


def memory_weights(att) -> dict[str, float]:
    """One output token's attention over memory items as ``{item label: weight}``, from any of the shapes the
    in-network methods report: a list of slot weights; a list of such lists (heads/layers, averaged); sparse
    ``[[item, weight], ...]`` pairs; ``{"weights": [...]}``; ``{"layers": {layer: [[item, weight], ...]}}``
    (averaged over layers); or ``{item: weight}``."""
    if att is None:
        return {}
    if isinstance(att, dict):
        if isinstance(att.get("weights"), list):
            return memory_weights(att["weights"])
        if isinstance(att.get("layers"), dict):
            per = [memory_weights(v) for v in att["layers"].values() if v]
            out: dict[str, float] = {}
            for d in per:
                for k, v in d.items():
                    out[k] = out.get(k, 0.0) + v / len(per)
            return out
        return {str(k): float(v) for k, v in att.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if isinstance(att, list) and att:
        if all(isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], int) for x in att):
            return {f"#{int(i)}": float(w) for i, w in att}
        if all(isinstance(x, list) for x in att):
            rows = [r for r in att if r and all(isinstance(v, (int, float)) for v in r)]
            if not rows:
                return {}
            width = min(len(r) for r in rows)
            return {f"m{j}": sum(r[j] for r in rows) / len(rows) for j in range(width)}
        if all(isinstance(x, (int, float)) for x in att):
            return {f"m{j}": float(w) for j, w in enumerate(att)}
    return {}


def memory_attention_heatmap(row: dict | None, title: str = "Attention over memory items",
                             max_items: int = 40) -> go.Figure:
    """Per output token, an in-network method's attention over its memory items (``memory_attention``); the
    ``max_items`` items with the largest weights are shown."""
    if not row:
        return empty("Pick a method")
    per_tok, toks = [], []
    for t in row.get("trace", []):
        w = memory_weights(t.get("memory_attention"))
        if w:
            per_tok.append(w)
            toks.append(t.get("text", ""))
    if not per_tok:
        return empty(f"{row.get('label', 'This method')} reports no attention over memory items")
    score: dict[str, float] = {}
    for w in per_tok:
        for k, v in w.items():
            score[k] = max(score.get(k, 0.0), v)
    items = sorted(score, key=lambda k: -score[k])[:max_items]
    z = [[w.get(k) for k in items] for w in per_tok]
    fig = go.Figure(go.Heatmap(z=z, y=_unique_labels(toks), x=items, colorscale="Blues", zmin=0,
                               colorbar=dict(thickness=10), hovertemplate="%{y} → %{x}: %{z:.3f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="memory item", type="category")
    return _layout(fig, f"{title} — {row.get('label', '')}", height=min(560, max(260, 16 * len(z) + 110)))


def input_attention_heatmap(att: dict | None, title: str = "") -> go.Figure:
    """The backbone's attention from output tokens (rows) to the input sentence's tokens (columns)."""
    if not att or not att.get("matrix"):
        return empty("Attention appears after a comparison")
    out, inp = att["output_tokens"], att["input_tokens"]
    fig = go.Figure(go.Heatmap(z=att["matrix"], y=_unique_labels(out), x=_unique_labels(inp),
                               colorscale="Purples", zmin=0, colorbar=dict(thickness=10),
                               hovertemplate="%{y} → %{x}: %{z:.3f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", title_text="output token")
    fig.update_xaxes(title_text="input token", tickangle=-30)
    t = title or f"Backbone attention, layer {att.get('layer', '?')} (heads averaged)"
    return _layout(fig, t, height=min(560, max(280, 16 * len(out) + 120)))


# --- evaluation ------------------------------------------------------------------------------------------------
def eval_bars(methods: list[dict], metrics: tuple[str, ...] = ("sacrebleu", "chrf"),
              title: str = "Scores by method") -> go.Figure:
    """Grouped bars: one group per metric, one bar per method."""
    if not methods:
        return empty("Run an evaluation to see scores")
    present = [m for m in metrics if any(isinstance(r.get(m), (int, float)) for r in methods)]
    if not present:
        return empty("The evaluation reported no scores")
    fig = go.Figure()
    for i, r in enumerate(methods):
        fig.add_trace(go.Bar(x=present, y=[r.get(m) for m in present], name=str(r.get("label", r.get("method"))),
                             marker_color=COLORS[i % len(COLORS)],
                             text=[f"{r.get(m):.1f}" if isinstance(r.get(m), (int, float)) else "" for m in present],
                             textposition="outside"))
    top = max((r.get(m) for r in methods for m in present if isinstance(r.get(m), (int, float))), default=1.0)
    fig.update_layout(barmode="group")
    fig.update_yaxes(range=[0, max(1.0, top) * 1.18])
    return _layout(fig, title)


def sweep_lines(points: list[dict], metric: str = "sacrebleu", title: str = "") -> go.Figure:
    """Score against λ_max, with and without Gradual Unrolling; a point with ``gu`` None (λ_max = 0: the base model,
    whatever GU says) starts both curves."""
    if not points:
        return empty("Run a λ_max sweep to see this chart")
    fig = go.Figure()
    for gu, name, dash in ((True, "with GU", "solid"), (False, "without GU", "dash")):
        pts = sorted((p for p in points if (p.get("gu") is None or bool(p.get("gu")) == gu)
                      and p.get(metric) is not None),
                     key=lambda p: p["lambda_max"])
        if pts:
            fig.add_trace(go.Scatter(x=[p["lambda_max"] for p in pts], y=[p[metric] for p in pts],
                                     mode="lines+markers", name=name,
                                     line=dict(dash=dash, width=2, color=COLORS[0 if gu else 1])))
    if not fig.data:
        return empty(f"No {metric} values in the sweep")
    fig.update_xaxes(title_text="λ_max", range=[-0.02, 1.02])
    fig.update_yaxes(title_text=metric)
    return _layout(fig, title or f"{metric} vs λ_max")


# --- memory profile and neighbour maps ----------------------------------------------------------------------------
MAP_COLORED_TOKENS = 8        # the most frequent value tokens get their own colour on a memory map; the rest grey
OTHER_COLOR = "#cbd5e1"
HIGHLIGHT_COLOR = "#dc2626"


def _xy(points) -> tuple[list, list]:
    return [p[0] for p in points], [p[1] for p in points]


def _axes(fig: go.Figure, explained: list | None) -> None:
    ex = list(explained or [0, 0]) + [0, 0]
    fig.update_xaxes(title_text=f"PC 1 ({100 * ex[0]:.0f}% of the variance)", zeroline=False)
    fig.update_yaxes(title_text=f"PC 2 ({100 * ex[1]:.0f}%)", zeroline=False)


def token_frequencies(profile: dict | None, top_n: int = 20, title: str = "") -> go.Figure:
    """The memory's most frequent value tokens (horizontal bars: count, share in the hover)."""
    top = (profile or {}).get("top_tokens") or []
    if not top:
        return empty("Pick a memory to see its value tokens")
    top = top[:top_n]
    labels = [f"{_tok(t['text'])}  #{t['token_id']}" for t in top]
    fig = go.Figure(go.Bar(x=[t["count"] for t in top], y=labels, orientation="h", marker_color=COLORS[0],
                           customdata=[round(100 * t["share"], 1) for t in top],
                           hovertemplate="%{y}: %{x} entries (%{customdata}%)<extra></extra>"))
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(title_text="entries with this value token")
    return _layout(fig, title or f"Value tokens: top {len(top)} of {profile.get('distinct_tokens', '?')}",
                   height=max(260, 20 * len(top) + 90))


def memory_map(profile: dict | None, token_id: int | None = None, title: str = "") -> go.Figure:
    """The profile's 2-D projection of sampled keys, coloured by value token (the most frequent ones; the rest
    grey). With ``token_id``: that token's keys highlighted (the others faded) and its centroid marked."""
    proj = (profile or {}).get("projection") or {}
    pts, toks = proj.get("points") or [], proj.get("tokens") or []
    if not pts:
        return empty("Pick a memory to see its keys on a map")
    names = {t["token_id"]: t["text"] for t in profile.get("top_tokens") or []}
    fig = go.Figure()
    if token_id is None:
        colored = [t["token_id"] for t in (profile.get("top_tokens") or [])[:MAP_COLORED_TOKENS]]
        groups = [(tid, _tok(names.get(tid, f"#{tid}")), COLORS[i % len(COLORS)], 6) for i, tid in enumerate(colored)]
        colored_set = set(colored)
        rest = [p for p, t in zip(pts, toks) if t not in colored_set]
        if rest:
            x, y = _xy(rest)
            fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name="other tokens", hoverinfo="skip",
                                     marker=dict(size=4, color=OTHER_COLOR)))
        for tid, label, color, size in groups:
            mine = [p for p, t in zip(pts, toks) if t == tid]
            x, y = _xy(mine)
            fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name=label, marker=dict(size=size, color=color),
                                     hovertemplate="%{fullData.name}<extra></extra>"))
    else:
        others = [p for p, t in zip(pts, toks) if t != token_id]
        mine = [p for p, t in zip(pts, toks) if t == token_id]
        label = _tok(names.get(token_id, f"#{token_id}"))
        if others:
            x, y = _xy(others)
            fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name="other tokens", hoverinfo="skip",
                                     marker=dict(size=4, color=OTHER_COLOR, opacity=0.6)))
        if mine:
            x, y = _xy(mine)
            fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name=f"“{label}”",
                                     marker=dict(size=9, color=HIGHLIGHT_COLOR, line=dict(color="white", width=1)),
                                     hovertemplate="%{fullData.name}<extra></extra>"))
            # the centroid as a ring, so the token's own keys stay visible where they coincide with it
            cx, cy = sum(x) / len(x), sum(y) / len(y)
            fig.add_trace(go.Scatter(x=[cx], y=[cy], mode="markers", name="its centroid", hoverinfo="skip",
                                     marker=dict(size=20, symbol="circle-open", color="#111827",
                                                 line=dict(color="#111827", width=2))))
    _axes(fig, proj.get("explained"))
    n = proj.get("sample_size", len(pts))
    return _layout(fig, title or f"Keys of {n:,} sampled entries (PCA), by value token", height=420)


def neighbour_map(m: dict | None, title: str = "") -> go.Figure:
    """One output token's query and its nearest memory entries on the memory's map
    (``NeighbourMapService.neighbour_map``); the profile's sampled keys in grey behind them."""
    if not m or not m.get("neighbours"):
        return empty("Pick a kNN or PEMA row and an output token")
    proj = m.get("projection") or {}
    fig = go.Figure()
    if proj.get("points"):
        x, y = _xy(proj["points"])
        fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name="memory keys (sample)", hoverinfo="skip",
                                 marker=dict(size=4, color=OTHER_COLOR, opacity=0.7)))
    qx, qy = m["query"]
    nbs = m["neighbours"]
    lx, ly = [], []
    for n in nbs:
        lx += [qx, n["xy"][0], None]
        ly += [qy, n["xy"][1], None]
    fig.add_trace(go.Scatter(x=lx, y=ly, mode="lines", line=dict(color="#94a3b8", width=1, dash="dot"),
                             hoverinfo="skip", showlegend=False))
    # neighbours at one spot (duplicate contexts in the memory) share one label: "3,4,5·h"; one spot = within 1%
    # of the map's extent
    xs = [p[0] for p in proj.get("points") or []] + [qx] + [n["xy"][0] for n in nbs]
    ys = [p[1] for p in proj.get("points") or []] + [qy] + [n["xy"][1] for n in nbs]
    eps = 0.01 * max(max(xs) - min(xs), max(ys) - min(ys), 1e-9)
    spots: list[tuple[float, float, str, list]] = []
    for n in nbs:
        spot = next((sp for sp in spots if sp[2] == n["token"] and abs(sp[0] - n["xy"][0]) <= eps
                     and abs(sp[1] - n["xy"][1]) <= eps), None)
        if spot is None:
            spots.append((n["xy"][0], n["xy"][1], n["token"], [n["rank"]]))
        else:
            spot[3].append(n["rank"])
    label_of = {ranks[0]: f"{','.join(map(str, ranks))}·{_tok(tok)}" for _, _, tok, ranks in spots}
    for same, name, color in ((True, "neighbour: the output token", COLORS[2]),
                              (False, "neighbour: another token", COLORS[1])):
        group = [n for n in nbs if bool(n.get("same_as_output")) == same]
        if not group:
            continue
        fig.add_trace(go.Scatter(
            x=[n["xy"][0] for n in group], y=[n["xy"][1] for n in group], mode="markers+text", name=name,
            text=[label_of.get(n["rank"], "") for n in group], textposition="top center",
            textfont=dict(size=11), marker=dict(size=11, color=color, line=dict(color="white", width=1)),
            customdata=[[n["rank"], _tok(n["token"]), n["distance"]] for n in group],
            hovertemplate="%{customdata[0]}. “%{customdata[1]}” distance %{customdata[2]:.3f}<extra></extra>"))
    q = m.get("query_label") or "query f(c)"
    fig.add_trace(go.Scatter(x=[qx], y=[qy], mode="markers", name=q, hovertemplate="%{fullData.name}<extra></extra>",
                             marker=dict(size=18, symbol="star", color=HIGHLIGHT_COLOR,
                                         line=dict(color="#111827", width=1))))
    _axes(fig, proj.get("explained"))
    t = title or f"{m.get('label', '')}: “{_tok(m.get('token', ''))}” (token {m.get('token_index', 0)}) among " \
                 f"the memory's keys"
    return _layout(fig, t, height=440)
