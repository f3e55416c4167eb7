"""HTML and table renderers: plain functions from service data to strings/rows (no Gradio here).

Everything that came from a user (sentences, names, samples, shared payloads) goes through :func:`esc`.
"""
from __future__ import annotations

import datetime as _dt
import html
import json

from ground.jobs import READ_ONLY_MESSAGE
from memories.nearness import profile_text
from studio.several_service import reference_scores

STATE_BADGE = {"queued": "#64748b", "running": "#2563eb", "done": "#16a34a", "failed": "#dc2626",
               "cancelled": "#a16207", "interrupted": "#a16207"}
KIND_LABEL = {"build_memory": "Build memory", "train_plugin": "Train plug-in", "evaluate": "Evaluate"}
KIND_SHORT = {"build_memory": "build", "train_plugin": "train", "evaluate": "evaluate"}


def esc(x) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def when(ts: float | None, short: bool = False) -> str:
    if not ts:
        return ""
    return _dt.datetime.fromtimestamp(ts).strftime("%b %d %H:%M" if short else "%Y-%m-%d %H:%M")


def progress_bar(frac: float, message: str = "", state: str = "running", title: str = "") -> str:
    pct = max(0.0, min(1.0, float(frac or 0))) * 100
    color = STATE_BADGE.get(state, "#2563eb")
    head = f"<div class='pema-pb-title'>{esc(title)}</div>" if title else ""
    return (f"<div class='pema-pb'>{head}<div class='pema-pb-track'><div class='pema-pb-fill' "
            f"style='width:{pct:.1f}%;background:{color}'></div></div>"
            f"<div class='pema-pb-msg'><span class='pema-badge' style='background:{color}'>{esc(state)}</span> "
            f"{pct:.0f}% — {esc(message)}</div></div>")


def status_header(st: dict) -> str:
    """The page header's backbone line (a progress bar while loading); first a warning when the studio runs
    read-only (another studio process owns the data directory)."""
    if st.get("read_only"):
        return (f"<div class='pema-status err'><b>Read-only</b>: {esc(READ_ONLY_MESSAGE)}</div>"
                + status_header({**st, "read_only": False}))
    if st.get("state") == "ready":
        precision = f" in {esc(st['precision'])}" if st.get("precision") else ""  # (docs/precision.md)
        return (f"<div class='pema-status ok'>Backbone <b>{esc(st['backbone'])}</b> ready on {esc(st['device'])}"
                f"{precision} · {st.get('layers', 0)} layers</div>")
    if st.get("state") == "failed":
        return f"<div class='pema-status err'>{esc(st.get('message'))}</div>"
    return progress_bar(st.get("progress", 0), f"{st.get('message', '')} ({st.get('elapsed', 0):.0f}s)",
                        "running", title=f"Loading the backbone {st.get('backbone', '')} — you can look around "
                                         f"meanwhile; jobs wait for it")


def duration(seconds: float | None) -> str:
    """``42s``, ``3m 05s``, ``1h 02m``; empty for None."""
    if seconds is None:
        return ""
    s = int(round(max(0.0, float(seconds))))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {(s % 3600) // 60:02d}m"


def job_time(job: dict) -> str:
    """Elapsed time and ETA of a job (``studio.plugin_service.job_timing``): "1m 05s elapsed · about 2m 10s
    left"; for a queued job how long it has waited; for a finished one how long it ran."""
    el, eta = job.get("elapsed_s"), job.get("eta_s")
    if job.get("state") == "queued":
        return f"waiting {duration(el)}" if el is not None else "waiting"
    if el is None:
        return ""
    if job.get("state") == "running":
        left = f"about {duration(eta)} left" if eta is not None else "estimating the time left…"
        return f"{duration(el)} elapsed · {left}"
    return f"ran {duration(el)}"


UNDER_TRAINED = "#d97706"


def job_badge(job: dict) -> tuple[str, str]:
    """(badge text, colour): the job's state, or "under-trained" for a training that stopped on its time budget."""
    tr = job.get("training") or {}
    if job.get("state") == "done" and tr.get("under_trained"):
        return "under-trained", UNDER_TRAINED
    return job.get("state", ""), STATE_BADGE.get(job.get("state"), "#2563eb")


def job_card(job: dict | None) -> str:
    if not job:
        return "<div class='pema-muted'>No job selected.</div>"
    title = f"{KIND_LABEL.get(job['kind'], job['kind'])} · {job['id']}"
    badge, color = job_badge(job)
    tr = job.get("training") or {}
    pct = max(0.0, min(1.0, float(job.get("progress") or 0))) * 100
    if badge == "under-trained":
        pct_text = ""  # "100%" would read as "fully trained"
        msg = job.get("message", "")
        msg = msg if tr["label"] in msg else f"{tr['label']}. {msg}"
    else:
        pct_text = f"{pct:.0f}% — "
        msg = job.get("message", "")
    timing = job_time(job)
    html_ = (f"<div class='pema-pb'><div class='pema-pb-title'>{esc(title)}</div><div class='pema-pb-track'>"
             f"<div class='pema-pb-fill' style='width:{pct:.1f}%;background:{color}'></div></div>"
             f"<div class='pema-pb-msg'><span class='pema-badge' style='background:{color}'>{esc(badge)}</span> "
             f"{pct_text}{esc(msg)}</div>"
             + (f"<div class='pema-pb-time'>{esc(timing)}</div>" if timing else "") + "</div>")
    if badge == "under-trained":
        html_ += ("<div class='pema-warn'>The time budget (<code>max_minutes</code>) ended training before the "
                  "early-stopping rule did: this plug-in is probably under-trained. Continue training it (Your "
                  "plug-ins → Continue training) or train again with a larger budget.</div>")
    if job["state"] == "failed" and job.get("error"):
        html_ += f"<div class='pema-error'>{esc(job['error'])}</div>"
    return html_


def job_what(job: dict, memory_names: dict | None = None) -> str:
    a = job.get("args", {})
    names = memory_names or {}
    if job["kind"] == "train_plugin":
        mem = names.get(a.get("memory_id"), a.get("memory_id", ""))
        return a.get("name") or f"{a.get('method', '')} on {mem}"
    if job["kind"] == "evaluate":
        return ("λ sweep" if a.get("mode") == "sweep" else "methods") + f" on {a.get('data', '')}"
    return a.get("name") or ""


def _job_progress(j: dict) -> str:
    if j.get("state") == "done" and (j.get("training") or {}).get("under_trained"):
        return "stopped early"
    return f"{100 * float(j.get('progress') or 0):.0f}%"


def jobs_table(jobs: list[dict], memory_names: dict | None = None) -> list[list]:
    return [[KIND_SHORT.get(j["kind"], j["kind"]), job_what(j, memory_names), job_badge(j)[0], _job_progress(j),
             job_time(j), j["id"]] for j in jobs]


JOB_HEADERS = ["kind", "what", "state", "progress", "time", "id"]


def memories_table(mems: list[dict]) -> list[list]:
    return [[m["name"], m["task"], m["samples"], m["entries"], m["backbone"] + ("" if m["usable"] else " ⚠"),
             m["size"], when(m["created"]), m["id"]] for m in mems]


MEMORY_HEADERS = ["name", "task", "samples", "entries", "backbone", "size on disk", "created", "id"]


def _metric_summary(metrics: dict) -> str:
    keys = [k for k in ("best_heldout_loss", "heldout_loss", "heldout_nll", "entries", "search") if k in metrics]
    parts = []
    for k in keys[:3]:
        v = metrics[k]
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    if not parts:
        for k, v in metrics.items():
            if isinstance(v, dict) and "best_heldout_loss" in v:
                parts.append(f"{k}: held-out {v['best_heldout_loss']:.4g}")
    return ", ".join(parts[:3])


def training_label(p: dict) -> str:
    """A plug-in's training status for lists: "⚠ stopped by time budget at 0.39 of 10 epochs — under-trained"."""
    tr = p.get("training") or {}
    label = tr.get("label") or "ready"
    return f"⚠ {label}" if tr.get("under_trained") else label


def plugins_table(plugins: list[dict]) -> list[list]:
    return [[p["name"], p["method"], training_label(p), p["memory"] + (f" · {p['task']}" if p.get("task") else ""),
             f"{p['params']:,}",
             _metric_summary(p.get("metrics") or {}), when(p["created"], short=True),
             p["backbone"] + ("" if p["usable"] else " ⚠")] for p in plugins]


PLUGIN_HEADERS = ["name", "method", "training", "memory · task", "parameters", "metrics", "created", "backbone"]


def plugin_status(p: dict | None) -> str:
    """One plug-in's training status line (for its details): under-trained in amber, with what to do."""
    if not p:
        return ""
    tr = p.get("training") or {}
    can = p.get("can_continue")
    if tr.get("under_trained"):
        todo = ("Press “Continue training” to resume from its saved optimizer state." if can else
                "Train it again with a larger time budget (max_minutes).")
        return (f"<div class='pema-warn'><b>{esc(p.get('name'))}</b>: {esc(tr.get('label'))}. {todo}</div>")
    more = " It can continue training." if can else ""
    return f"<div class='pema-muted'><b>{esc(p.get('name'))}</b>: {esc(tr.get('label') or 'ready')}.{more}</div>"


def memory_warning(m: dict | None, purpose: str) -> str:
    """A warning when a memory is too small for ``purpose`` ("train": a plug-in learns from its training
    samples and early-stops on a tenth of them; "heldout": Compare's samples and Evaluate need held-out samples);
    empty when it is fine. ``m``: a row of ``MemoryService.memories``."""
    if not m:
        return ""
    held = int(m.get("heldout_samples") or 0)
    train = max(0, int(m.get("samples") or 0) - held)  # ``samples`` counts the held-out ones too
    if purpose == "heldout" and held == 0:
        return (f"<div class='pema-warn'><b>{esc(m.get('name'))}</b> has 0 held-out samples (a memory needs at "
                f"least 5 samples to hold some out): there is nothing to evaluate on. Upload a test file instead, "
                f"or rebuild the memory from more samples.</div>")
    if purpose == "heldout" and held < 10:
        return (f"<div class='pema-warn'><b>{esc(m.get('name'))}</b> holds out only {held} sample(s): scores on "
                f"so few sentences are mostly noise (below 5 there are no confidence intervals); a test file of "
                f"more pairs tells more.</div>")
    if purpose == "train" and train < 2:
        return (f"<div class='pema-warn'><b>{esc(m.get('name'))}</b> has {train} training sample(s): too few to "
                f"train on (a tenth of them is set aside for early stopping). Build a memory from more samples."
                f"</div>")
    if purpose == "train" and train < 20:
        return (f"<div class='pema-warn'><b>{esc(m.get('name'))}</b> has only {train} training samples: a plug-in "
                f"trained on so few early-stops on {max(1, round(train / 10))} of them and will mostly memorise."
                f"</div>")
    return ""


def preview_summary(pv: dict) -> str:
    if not pv.get("count") and not pv.get("problems"):
        return "<div class='pema-muted'>Upload a file, paste samples or pick a demo corpus to preview it.</div>"
    parts = [f"<b>{pv['count']}</b> sample(s) parsed" + (f" ({esc(pv['format'])})" if pv.get("format") else "")]
    if pv.get("monolingual"):
        parts.append(f"{pv['monolingual']} without a source (the backbone will write a synthetic one)")
    cls = "ok" if pv.get("ok") else ("warn" if pv.get("count") else "err")
    out = f"<div class='pema-status {cls}'>{' · '.join(parts)}</div>"
    if pv.get("problems"):
        n = pv.get("problem_count", len(pv["problems"]))
        items = "".join(f"<li>{esc(p)}</li>" for p in pv["problems"][:30])
        more = f"<li>… and {n - 30} more</li>" if n > 30 else ""
        out += (f"<div class='pema-error'><b>{n} problem(s)</b> — fix them, or tick “skip invalid lines” to "
                f"build from the valid samples only:<ul>{items}{more}</ul></div>")
    return out


def _diff_html(diff: list[list]) -> str:
    out = []
    for seg, tag in diff:
        if not seg:
            continue
        if tag == "added":
            out.append(f"<ins>{esc(seg)}</ins>")
        elif tag == "removed":
            out.append(f"<del>{esc(seg)}</del>")
        else:
            out.append(esc(seg))
    return " ".join(out) or "<span class='pema-muted'>(empty output)</span>"


def _settings_text(settings: dict) -> str:
    keep = {k: v for k, v in (settings or {}).items() if not isinstance(v, (dict, list))}
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in keep.items())


def output_cards(payload: dict | None, shared: bool = False) -> str:
    """Side-by-side output cards; each method's differences from the base output are highlighted."""
    if not payload:
        return ("<div class='pema-muted'>Type a sentence, choose methods and press <b>Compare</b>. Outputs "
                "appear here side by side.</div>")
    t = payload.get("timings", {})
    n = len(payload["rows"])
    loaded = f", plug-ins loaded in {t['load_plugins_s']:.2f}s" if t.get("load_plugins_s", 0) > 0.05 else ""
    reuse = t.get("reuse") or {}
    if shared:  # the owner's last action and its timing (a slider move, a re-decode) mean nothing to a recipient
        head_text = f"{n} method(s), decoded in one batch ({payload.get('steps', 0)} steps)"
    elif reuse.get("kind") == "slider move":  # answered from the kept decode: a token rate would mean nothing here
        passes = reuse.get("forward_passes") or 0
        what = (f"{passes} backbone forward pass(es) from the first changed step" if passes
                else "no token changed, no forward pass")
        head_text = (f"Re-decoded {n} method(s) from the kept decode: <b>{t.get('decode_s', 0):.2f}s</b> "
                     f"({what}; {reuse.get('reused_steps', 0)} row-steps reused{loaded})")
    else:
        head_text = (f"One batched decode of {n} method(s): <b>{t.get('decode_s', 0):.2f}s</b> "
                     f"({payload.get('steps', 0)} steps, {t.get('tokens', 0)} tokens, "
                     f"{t.get('tokens_per_s', 0):.0f} tok/s{loaded})")
    total = "" if shared else f" · total {t.get('total_s', 0):.2f}s"
    head = (f"<div class='pema-timing'>{head_text}{total} · differences from the base "
            f"output: <ins>added</ins> <del>removed</del></div>")
    ref = (f"<div class='pema-ref'><span>Reference</span> {esc(payload['reference'])}</div>"
           if payload.get("reference") else "")
    used = prompt_label(payload.get("prompt_source") or payload.get("base_examples"))
    if used:
        head += (f"<div class='pema-help' id='{'shared' if shared else 'compare'}-prompt-used'>Prompt of every row "
                 f"without its own: <b>{esc(used)}</b></div>")
    cards = []
    base = payload.get("base_label")
    # the user gave a reference (a held-out sample): each output's sentence-level sacreBLEU and chrF against it
    vs_ref = dict(zip((r["label"] for r in payload["rows"]),
                      reference_scores([r["text"] for r in payload["rows"]],
                                       [payload["reference"]] * len(payload["rows"])))) \
        if payload.get("reference") and payload["rows"] else {}
    for r in payload["rows"]:
        is_base = r["label"] == base
        body = esc(r["text"]) if is_base else _diff_html(r.get("diff") or [[r["text"], "same"]])
        plain = esc(r["text"])
        if not r["text"]:
            body = plain = "<span class='pema-muted'>(empty output)</span>"
        toggle = "" if is_base else (f"<button type='button' class='pema-act' data-pema-action='view' "
                                     f"title='{esc(VIEW_HELP)}'>Plain text</button>")
        cards.append(
            f"<div class='pema-card{' base' if is_base else ''}'>"
            f"<div class='pema-card-head'><b title='{esc(r['label'])}'>{esc(r['label'])}</b>"
            f"<span class='pema-method'>{esc(r['method'])}</span></div>"
            f"<div class='pema-card-prompt pema-muted'>{esc(_row_prompt(r, used))}</div>"
            f"<div class='pema-card-text pema-card-diff'>{body}</div>"
            f"<div class='pema-card-text pema-card-plain'>{plain}</div>"
            f"<div class='pema-card-foot'>{r.get('n_tokens', len(r.get('tokens', [])))} tokens · "
            f"<abbr class='pema-term' title='{esc(SCORE_HELP)}'>score</abbr> {r.get('score', 0):.2f}"
            f"{' · ' + esc(_settings_text(r.get('settings'))) if r.get('settings') else ''}"
            f"{_reference_foot(vs_ref.get(r['label']))}</div>"
            f"<div class='pema-card-actions'><button type='button' class='pema-act' data-pema-action='copy' "
            f"title='Copy this output to the clipboard'>Copy</button>{toggle}</div></div>")
    return f"{head}{ref}<div class='pema-cards'>{''.join(cards)}</div>"


def prompt_label(source: dict | None) -> str:
    """What the rows without their own prompt read (a payload's ``prompt_source``): the owner's label, or in a share
    (``base_examples``: kind and number only) a neutral one."""
    if not source:
        return ""
    if source.get("label"):
        return source["label"]
    n = source.get("count")
    what = "built-in examples" if source.get("kind") == "builtin" else "the memory's own examples"
    return f"{what} ({n})" if n is not None else what


def _row_prompt(row: dict, used: str) -> str:
    """One card's prompt: its own (the retrieved examples) or the comparison's."""
    own = row.get("prompt")
    if own or row.get("own_examples"):
        n = len((own or {}).get("examples") or []) if isinstance(own, dict) else None
        return f"prompt: its own ({n} retrieved examples)" if n is not None else "prompt: its own"
    return f"prompt: {used}" if used else ""


def _reference_foot(scores: dict | None) -> str:
    if not scores:
        return ""
    return (f" · <abbr class='pema-term pema-vs-ref' title='{esc(REFERENCE_HELP)}'>vs reference</abbr> "
            f"{_scores_text(scores)}")


REFERENCE_HELP = ("This output against the reference shown above: sacreBLEU at sentence level (effective order) and "
                  "chrF, from sacrebleu. One sentence is a noisy measure: use the Evaluate tab for a test set.")
SCORE_HELP = ("score: the output's log-probability under its row's final distribution — the sum of log P of the "
              "chosen tokens (0 = certain; more negative = less confident; longer outputs score lower, so compare "
              "scores of outputs of similar length only)")
VIEW_HELP = "Switch between the differences from the base output and the plain output"

# The cards' buttons (the HTML component's own script, run once when it loads; it listens on the container, so it
# works for every new set of cards): Copy puts the card's plain output on the clipboard; Plain text / Show diff
# switches the card between its differences from the base output and the plain output.
CARDS_JS = """
element.addEventListener('click', (ev) => {
  const btn = ev.target.closest('[data-pema-action]');
  if (!btn || !element.contains(btn)) return;
  const card = btn.closest('.pema-card');
  if (!card) return;
  if (btn.dataset.pemaAction === 'view') {
    card.classList.toggle('plain');
    btn.textContent = card.classList.contains('plain') ? 'Show diff' : 'Plain text';
    return;
  }
  const text = (card.querySelector('.pema-card-plain') || card).innerText.trim();
  const done = () => { btn.textContent = 'Copied'; setTimeout(() => { btn.textContent = 'Copy'; }, 1200); };
  const fallback = () => {
    const ta = document.createElement('textarea');
    ta.value = text; ta.style.position = 'fixed'; ta.style.opacity = '0';
    document.body.appendChild(ta); ta.select();
    try { document.execCommand('copy'); } finally { document.body.removeChild(ta); }
    done();
  };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(done, fallback);
  } else {
    fallback();
  }
});
"""


def shared_header(payload: dict) -> str:
    return (f"<div class='pema-shared'><div><b>Shared comparison</b> (read-only) · task {esc(payload.get('task'))}"
            f" · backbone {esc(payload.get('backbone'))} · shared {esc(when(payload.get('shared')))}</div>"
            f"<div class='pema-shared-src'>{esc(payload.get('source'))}</div>"
            f"<div class='pema-muted'><a href='../'>open your own studio</a></div></div>")


def token_chips(row: dict | None, selected: int) -> list[tuple[str, str | None]]:
    """HighlightedText value for a row's output tokens; the selected one is marked, λ_t shown by category."""
    if not row:
        return []
    out = []
    for i, t in enumerate(row.get("token_texts") or []):
        text = t.replace("\n", "⏎") or "∅"
        if i == selected:
            cat = "selected"
        else:
            lam = (row["trace"][i].get("lambda") if i < len(row.get("trace", [])) else None)
            cat = None if lam is None else ("λ high" if lam >= 0.5 else ("λ low" if lam > 0 else None))
        out.append((text, cat))
    return out


def settings_json(d: dict) -> str:
    return json.dumps(d, indent=2, ensure_ascii=False)


# --- memory profile, neighbour maps, several sentences -------------------------------------------------------------
# Styles of the views below, sent with their HTML (one <style> block a view; the page's CSS is ui/common.py's).
EXPLORE_CSS = """<style>
.pema-x mark { background: rgba(234,88,12,.22); color: inherit; border-radius: 3px; padding: 0 2px;
               outline: 1px solid rgba(234,88,12,.55); }
.pema-x table { border-collapse: collapse; width: 100%; font-size: 0.9rem; table-layout: auto; }
.pema-x th, .pema-x td { border-bottom: 1px solid var(--border-color-primary); padding: 4px 6px; text-align: left;
                         vertical-align: top; overflow-wrap: anywhere; }
.pema-x th { font-weight: 600; white-space: nowrap; }
.pema-x td.num { white-space: nowrap; text-align: right; }
.pema-x .pema-score { display: block; font-size: 0.78rem; color: var(--body-text-color-subdued); }
.pema-x .pema-stats { display: flex; flex-wrap: wrap; gap: 6px 14px; margin: 4px 0 8px; }
.pema-x .pema-stats span b { font-size: 1.05rem; }
.pema-x .pema-same { color: #16a34a; font-weight: 600; }
.pema-x-scroll { overflow-x: auto; max-height: 520px; overflow-y: auto; }
</style>"""


def _visible(t: str) -> str:
    """A token or text piece with visible line breaks and an empty token shown."""
    return str(t).replace("\n", "⏎") if t not in (None, "") else "∅"


def marked(before: str, match: str, after: str) -> str:
    """A sentence with one token marked (``<mark>``), everything escaped."""
    return f"{esc(before)}<mark>{esc(_visible(match))}</mark>{esc(after)}"


def profile_summary(prof: dict | None) -> str:
    """A memory profile's counts, and what its map is."""
    if not prof:
        return "<div class='pema-muted'>Pick a memory above to see its profile.</div>"
    proj = prof.get("projection") or {}
    ex = proj.get("explained") or [0, 0]
    stats = [("entries", f"{prof['entries']:,}"), ("training samples", f"{prof['samples']:,}"),
             ("held-out samples", f"{prof['heldout_samples']:,}"),
             ("entries per sample", f"{prof['entries_per_sample']:g}"),
             ("distinct value tokens", f"{prof['distinct_tokens']:,}"),
             ("key size d", f"{prof.get('hidden_size') or '?'}"), ("key RMS", f"{prof['key_rms']:g}")]
    items = "".join(f"<span><b>{esc(v)}</b> {esc(k)}</span>" for k, v in stats)
    spread = prof.get("overall_spread")
    return (f"{EXPLORE_CSS}<div class='pema-x' id='memory-profile-summary'><div class='pema-stats'>{items}</div>"
            f"<div class='pema-help'>Map: {esc(proj.get('method', ''))}; {proj.get('sample_size', 0):,} entries "
            f"shown (seed {proj.get('seed', 0)}); the two axes explain {100 * ex[0]:.0f}% and {100 * ex[1]:.0f}% "
            f"of their variance. Spread = RMS distance of a token's keys from their centroid in the full key space"
            f"{f' (all sampled keys: {spread:g})' if spread is not None else ''}: small = its contexts agree."
            f"</div>{split_summary(prof.get('split'))}</div>")


def transfer_note(check: dict | None, elem_id: str = "transfer-note") -> str:
    """The transfer check (``eval.transfer``) where scores are read: a warning when the inputs are farther from the
    memory than its held-out samples, a plain note when they are about as near; nothing without one."""
    if not check or not check.get("text"):
        return ""
    kind = "pema-warn" if check.get("farther") else "pema-help"
    mem = f" (memory {esc(check['memory_name'])})" if check.get("memory_name") else ""
    return f"<div class='{kind}' id='{esc(elem_id)}'>{esc(check['text'])}{mem}</div>"


def rank_transfer_html(board: dict | None) -> str:
    """A rank on a test file: the transfer check, and each method's chrF difference to the base model on the
    held-out report part beside the test's (the two leaderboards side by side, compactly)."""
    if not board or not board.get("transfer"):
        return ""
    html_ = transfer_note(board["transfer"], "rank-transfer")
    held = board.get("heldout")
    if held:
        test = {r["method"]: r for r in board.get("methods") or []}

        def cell(r: dict | None) -> str:
            if not r or r.get("chrf_delta") is None:
                return "—"
            return f"{r['chrf_delta']:+.1f} (p {r['p_chrf']:.3f})"

        rows = "".join(f"<tr><td>{esc(r.get('title', r['method']))}</td><td>{esc(cell(r))}</td>"
                       f"<td>{esc(cell(test.get(r['method'])))}</td></tr>"
                       for r in held["methods"] if r["method"] != "base")
        html_ += (f"<div class='pema-help' id='rank-heldout-beside'><b>Held-out vs test</b> — ΔchrF over the base "
                  f"model on the {held['data']['report']} held-out report samples and on the test file:"
                  f"<table><tr><th>method</th><th>held-out</th><th>test</th></tr>{rows}</table>"
                  f"Held-out: {esc(held.get('verdict', ''))}</div>")
    return html_


def split_summary(split: dict | None) -> str:
    """How a memory's held-out samples were chosen and how near their sources are to the training ones."""
    if not split or not (split.get("heldout_profile") or {}).get("n"):
        return ""
    how = ("grouped: near-duplicate sources (Jaccard ≥ {:g}) kept on one side".format(split.get("threshold", 0.5))
           if split.get("method") == "grouped" else f"random ({split.get('note', '')})")
    return (f"<div class='pema-help' id='memory-split'>Held-out split: {esc(how)}. "
            f"{esc(profile_text(split['heldout_profile'], 'Held-out sources'))}.</div>")


def token_choices(prof: dict | None) -> list[tuple[str, int]]:
    """Dropdown choices for a profile's frequent tokens: ("“Haus” #123 · 41 entries", 123)."""
    return [(f"“{_visible(t['text'])}” #{t['token_id']} · {t['count']:,} entries", t["token_id"])
            for t in (prof or {}).get("top_tokens") or []]


def token_detail(info: dict | None) -> str:
    """A picked value token: count, spread beside the sample's, and a few occurrences with the token marked."""
    if not info:
        return ""
    spread, overall = info.get("spread"), info.get("overall_spread")
    spread_txt = ("spread not measurable (fewer than 2 of its keys in the sample)" if spread is None else
                  f"spread <b>{spread:g}</b> (all sampled keys: {overall:g})")
    rows = "".join(f"<tr><td class='num'>{o['entry']:,}</td><td>{esc(o['source'])}</td>"
                   f"<td>{marked(o['before'], o['match'], o['after'])}</td></tr>" for o in info.get("occurrences", []))
    table = (f"<table><thead><tr><th>entry</th><th>source</th><th>target (the token marked)</th></tr></thead>"
             f"<tbody>{rows}</tbody></table>") if rows else ""
    return (f"{EXPLORE_CSS}<div class='pema-x' id='memory-token-detail'><div>“{esc(_visible(info['text']))}” "
            f"#{info['token_id']}: <b>{info['count']:,}</b> entries ({100 * info['share']:.1f}%), "
            f"{info['in_sample']:,} of them in the map's sample of {info['sample_size']:,} · {spread_txt}</div>"
            f"{table}</div>")


def neighbour_list(m: dict | None) -> str:
    """A neighbour map's entries: rank, value token (✓ when it is the output token), distance, the memory sample's
    source and its target with the value token marked."""
    if not m:
        return ("<div class='pema-muted'>Run a comparison with a kNN or PEMA plug-in: the map shows, for the output "
                "token you pick, where the query lands among the memory's keys and its nearest entries.</div>")
    rows = []
    for n in m["neighbours"]:
        same = " <span class='pema-same' title='the output token'>✓</span>" if n.get("same_as_output") else ""
        rows.append(f"<tr><td class='num'>{n['rank']}</td><td>{esc(_visible(n['token']))}{same}</td>"
                    f"<td class='num'>{n['distance']:.3f}</td><td>{esc(n['source'])}</td>"
                    f"<td>{marked(n['before'], n['match'], n['after'])}</td></tr>")
    head = (f"<div class='pema-help'><b>Query</b>: {esc(m['query_kind'])}. <b>Neighbours</b>: "
            f"{esc(m['neighbour_kind'])}; distance = squared L2 to the query (keys / key RMS). "
            f"{m['matching']} of {len(m['neighbours'])} have the output token “{esc(_visible(m['token']))}” as "
            f"their value (✓). Memory: {esc(m.get('memory_name', ''))}.</div>")
    return (f"{EXPLORE_CSS}<div class='pema-x' id='neighbour-list'>{head}<table><thead><tr><th>rank</th>"
            f"<th>value token</th><th>distance</th><th>memory sample: source</th>"
            f"<th>memory sample: target (the value token marked)</th></tr></thead><tbody>{''.join(rows)}</tbody>"
            f"</table></div>")


def _scores_text(s: dict | None) -> str:
    return "" if not s else f"BLEU {s['sacrebleu']:.1f} · chrF {s['chrf']:.1f}"


def several_table(res: dict | None) -> str:
    """The several-sentences result: one row a sentence, one column a method; each output's sentence-level
    sacreBLEU/chrF under it where the line gave a reference, and the corpus scores in the last row."""
    if not res:
        return ("<div class='pema-muted'>Paste sentences, one a line — optionally “sentence ||| reference” or "
                "sentence&lt;TAB&gt;reference — and press <b>Compare all</b>: every chosen method decodes them "
                "together in one batch.</div>")
    cols = res["columns"]
    any_ref = any(ln.get("reference") for ln in res["lines"])
    head = "<th>#</th><th>sentence</th>" + ("<th>reference</th>" if any_ref else "") + \
        "".join(f"<th title='{esc(_settings_text(c.get('settings')))}'>{esc(c['label'])}</th>" for c in cols)
    body = []
    for ln in res["lines"]:
        cells = [f"<td class='num'>{ln['line']}</td>", f"<td>{esc(ln['source'])}</td>"]
        if any_ref:
            cells.append(f"<td>{esc(ln.get('reference') or '—')}</td>")
        for j, out in enumerate(ln["outputs"]):
            sc = (ln.get("scores") or [None] * len(cols))[j]
            score = f"<span class='pema-score'>{_scores_text(sc)}</span>" if sc else ""
            text = esc(out) if out else "<span class='pema-muted'>(empty output)</span>"
            cells.append(f"<td>{text}{score}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    if res.get("corpus"):
        by = {c["label"]: c for c in res["corpus"]}
        n = res["corpus"][0]["n"]
        cells = [f"<td></td><td><b>corpus</b> ({n} sentence{'s' if n != 1 else ''} with a reference)</td>"]
        if any_ref:
            cells.append("<td></td>")
        cells += [f"<td><b>{_scores_text(by.get(c['label']))}</b></td>" for c in cols]
        body.append(f"<tr class='pema-corpus'>{''.join(cells)}</tr>")
    t = res.get("timings") or {}
    info = (f"<div class='pema-timing'>One batched decode of {t.get('sentences', len(res['lines']))} sentence(s) × "
            f"{len(cols)} method(s): <b>{t.get('decode_s', 0):.2f}s</b> ({t.get('tokens', 0)} tokens, "
            f"{t.get('tokens_per_s', 0):.0f} tok/s) · scores: sacreBLEU (sentence level, effective order) and chrF "
            f"against each line's reference · hover a method's name for its settings</div>")
    used = prompt_label(res.get("prompt_source"))
    if used:
        info += (f"<div class='pema-help' id='several-prompt-used'>Prompt of every column without its own: "
                 f"<b>{esc(used)}</b></div>")
    return (f"{EXPLORE_CSS}<div class='pema-x' id='several-result'>{info}<div class='pema-x-scroll'>"
            f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div></div>")
