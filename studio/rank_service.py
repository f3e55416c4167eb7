"""The Studio's rankings: "rank every method" on one of the owner's memories as one background job (``eval.rank``:
train or reuse, calibrate, evaluate, verdict), its leaderboard, the best method per memory (Compare's picker marks
it), read-only leaderboard shares, and the first-run tour (build the demo corpus's memory, then rank on it).

A restart mid-ranking: the job queue marks the running job ``interrupted``; the studio then queues it again as a new
job (``resume_of`` names the old one), which reuses every plug-in the first run finished (same method, same settings,
same memory) and every calibration it stored, so it goes on where the first one stopped. One automatic resume per
ranking chain and restart at most twice: a ranking that keeps taking the studio down is not restarted forever.
"""
from __future__ import annotations

import json
import time

from eval import calibrate
from eval.rank import COST_SENTENCES, decoding_seconds, find_trained, wanted_methods
from eval.rank import rank as run_rank
from ground.errors import UserError
from ground.jobs import JobContext
from plugins.api import make_config, open_memory
from plugins.estimate import estimate, machine_kind
from plugins.registry import get_method
from plugins.timing import minutes
from studio.backbone_service import BackboneService
from studio.caches import LRU
from studio.context import StudioContext
from studio.evaluate_service import read_test_pairs
from studio.gate import BackboneGate
from studio.limits import hint
from studio.memory_service import MemoryService
from studio.payload import json_safe
from studio.ray_executor import RankTrainer

MAX_RESUMES = 2  # automatic resumes of one ranking after restarts
TOUR_CORPUS = "gettext-de"  # the demo corpus the first-run tour ranks on
TOUR_CORPORA = {"translation": TOUR_CORPUS, "formality": "formality-en"}  # the tour's demo corpus per task
TOUR_LIMIT = 1000  # its samples: 100 held out (40 tune, 60 report)
# Decode seconds per sentence and row (greedy, ≈ 30 tokens) for the tour's estimate before any decode was timed.
# seconds the base model takes to decode one held-out sentence alone, per backbone and kind of machine
# (plugins.estimate.machine_kind), for the estimate said before a rank starts: a rank's decode-speed phase ÷ its
# sentences (BENCHMARKS.md, "Ranking every method": both kinds' ranks)
DECODE_S_PER_SENTENCE = {"gemma-3-270m@cpu-bf16": 0.89, "gemma-3-270m@cpu-avx2": 1.5, "gemma-3-270m": 1.5}


def decode_s_per_sentence(backbone_name: str) -> float:
    """This machine kind's entry for ``backbone_name``, else the backbone's, else a small model's guess."""
    return DECODE_S_PER_SENTENCE.get(f"{backbone_name}@{machine_kind()}",
                                     DECODE_S_PER_SENTENCE.get(backbone_name, 0.05))


def training_seconds(per_method: dict[str, float], slots: int | None = None) -> float:
    """A ranking's training phase from its methods' estimates: their sum in one process; with ``slots`` workers
    (``studio.ray_executor.RankTrainer``) the methods that index only (kNN, retrieval) first, then the others side by
    side, so about the slowest of them when there are as many workers as methods (longest first onto the least
    loaded worker otherwise)."""
    if not slots:
        return sum(per_method.values())
    here = sum(s for m, s in per_method.items() if not RankTrainer.runs(m))
    loads = [0.0] * max(1, int(slots))
    for s in sorted((s for m, s in per_method.items() if RankTrainer.runs(m)), reverse=True):
        loads[loads.index(min(loads))] += s
    return here + max(loads)


SHARE_KIND = "leaderboard"
REMOTE = ("Ranking trains every method, the in-network ones too, which need the decoder's layers: it runs on the "
          "local backbone, not a model owner's service.")
# What a leaderboard share keeps of each row: scores, costs and settings, never an id, a name or a sample.
SHARED_ROW_KEYS = ("rank", "method", "title", "level", "chrf", "sacrebleu", "chrf_ci95", "sacrebleu_ci95",
                   "chrf_delta", "p_chrf", "sacrebleu_delta", "p_sacrebleu", "training_seconds",
                   "trainable_parameters", "decode_cost", "settings", "tuned", "best", "n", "p_chrf_holm",
                   "p_sacrebleu_holm", "calibration_evidence")


class RankService:
    """Rank jobs, leaderboards and their shares.

    Receives the context, the backbone service and its gate (the ranking job holds it), the memories (the memory
    ranked on; the tour's build) and the loaded plug-in cache (a ranking recalibrates plug-ins: their loaded
    copies go); ``executor``: the studio's Ray executor, when it runs with workers (a ranking's trainings then run
    at once on them)."""

    def __init__(self, ctx: StudioContext, backbone_svc: BackboneService, gate: BackboneGate,
                 memory_svc: MemoryService, plugin_cache: LRU, executor=None):
        self.ctx = ctx
        self.backbone_svc = backbone_svc
        self.gate = gate
        self.memory_svc = memory_svc
        self.plugin_cache = plugin_cache
        self.executor = executor

    @property
    def job_handlers(self) -> dict:
        """The job kinds this service submits, with their handlers (``JobQueue.handlers``)."""
        return {"rank": self.job_rank}

    def submit_rank(self, memory_id: str | None = None, *, methods: list[str] | None = None,
                    test_data: bytes | str | None = None, test_filename: str | None = None,
                    corpus: str | None = None, corpus_limit: int | None = None,
                    owner: str | None = None) -> str:
        """Queue "rank every method" (or ``methods``) on one of the owner's memories — or, with ``corpus`` (the
        first-run tour), on a memory built from that demo corpus first (its build job runs before the ranking).
        ``test_data``: report on this uploaded test file of pairs instead of the held-out report part."""
        owner = self.ctx.owner(owner)
        self.ctx.limits.check_rate("evaluations_per_minute", owner)
        names = self._rank_methods(methods)
        args: dict = {"methods": names}
        if test_data:
            pairs = read_test_pairs(self.ctx.limits, test_data, test_filename)
            self.ctx.limits.check("eval_pairs", len(pairs), "The number of test pairs")
            args.update(pairs=pairs, data=test_filename or "uploaded test file")
        if corpus:
            return self._submit_tour(args, names, corpus, corpus_limit, owner)
        else:
            if not memory_id:
                raise UserError("Choose a memory to rank the methods on.")
            row = self.memory_svc.memory_row(memory_id, owner)
            bb = self.backbone_svc.loaded_backbone()
            fp = bb.fingerprint if bb is not None else row["fingerprint"]
            to_train = sum(find_trained(self.ctx.catalog, owner, memory_id, m, make_config(m, {}).to_dict(), fp) is None
                           for m in names)
            args.update(memory_id=memory_id, to_train=to_train)
        with self.ctx.admission:
            self._rank_quota(owner, to_train)
            return self.ctx.jobs.submit("rank", args, owner=owner)

    def _submit_tour(self, args: dict, names: list[str], corpus: str, corpus_limit: int | None, owner: str) -> str:
        """The first-run tour: a build of the demo corpus, then the ranking on it. Everything is checked before
        anything is queued (tours per owner and overall, the plug-in and memory quotas counting the work in flight,
        room for both jobs), and a build whose ranking is then refused goes again: a refused tour leaves nothing."""
        args.update(to_train=len(names), tour=True)
        with self.ctx.admission:
            tours = [j for j in self.ctx.jobs.list(kinds=("rank",), states=("queued", "running"), limit=1000)
                     if (j.get("args") or {}).get("tour")]
            limits = self.ctx.limits
            mine = sum(j.get("owner") == owner for j in tours)
            if limits.tours_per_owner and mine >= limits.tours_per_owner:
                raise UserError(f"Your first-run tour is already under way ({mine} queued or running; the limit "
                                f"per user is {limits.tours_per_owner}); follow it in the Jobs list "
                                f"({hint('tours_per_owner')}).")
            if limits.tours_total and len(tours) >= limits.tours_total:
                raise UserError(f"{len(tours)} first-run tours are under way on this studio (the limit is "
                                f"{limits.tours_total}); try again in a few minutes, or rank the methods on a memory "
                                f"of your own ({hint('tours_total')}).")
            self._rank_quota(owner, len(names))
            self.memory_svc.memory_quota(owner)
            self.ctx.jobs.check_room(owner, 2)
            build = self.memory_svc.submit_build(corpus=corpus, limit=corpus_limit or TOUR_LIMIT,
                                                 name=f"{corpus} (tour)", owner=owner)
            try:
                return self.ctx.jobs.submit("rank", {**args, "build_job": build}, owner=owner)
            except BaseException:
                if not self.ctx.jobs.discard(build):
                    self.ctx.jobs.cancel(build, owner)
                raise

    def _rank_methods(self, methods) -> list[str]:
        if methods is not None and not isinstance(methods, (list, tuple)):
            raise UserError('Methods must be a list like ["pema", "knn"] (empty: every method).')
        if self.backbone_svc.offsite():
            raise UserError(REMOTE)
        return wanted_methods([m for m in methods or [] if m and m != "base"] or None)

    def _rank_quota(self, owner: str, to_train: int) -> None:
        # one check for all the plug-ins it trains (check_quota refuses one more when ``have`` reaches the bound),
        # counting those the owner's queued or running trainings and rankings will add
        if to_train:
            self.ctx.limits.check_quota("plugins_per_owner", self.ctx.catalog.count("plugins", owner) + to_train - 1
                                        + self.ctx.plugins_in_flight(owner),
                                        "plug-ins (with the ones this ranking and the jobs under way train)")

    def rank_estimate(self, memory_id: str | None = None, *, corpus: str | None = None,
                      corpus_limit: int | None = None, methods: list[str] | None = None,
                      owner: str | None = None) -> dict:
        """How long ranking will take, said before it starts: the training estimates (``plugins.estimate``; a
        plug-in that would be reused costs nothing) plus calibration and decoding from a per-sentence decode time.
        ``{"seconds", "text", "per_method"}``."""
        owner = self.ctx.owner(owner)
        names = self._rank_methods(methods)
        bb = self.backbone_svc.loaded_backbone()
        bb_name = bb.name if bb is not None else self.backbone_svc.requested_name()
        if corpus:
            n = int(corpus_limit or TOUR_LIMIT)
            held = max(1, round(n * 0.1))
            samples, entries, reuse = n - held, (n - held) * 12, {}
        else:
            row = self.memory_svc.memory_row(memory_id, owner)
            samples, entries = int(row["samples"] or 0), int(row["entries"] or 0)
            held = max(1, round(samples * 0.1))
            samples -= held
            fp = bb.fingerprint if bb is not None else row["fingerprint"]
            reuse = {m: find_trained(self.ctx.catalog, owner, memory_id, m, make_config(m, {}).to_dict(), fp)
                     for m in names}
        per, unmeasured = {}, []
        for m in names:
            if reuse.get(m):
                per[m] = 0.0
                continue
            est = estimate(m, {}, bb_name, samples, entries)
            if not est.get("measured"):
                unmeasured.append(get_method(m).title)
            per[m] = float(est.get("converge_s") or 0.0)
        spr = decode_s_per_sentence(bb_name)
        tune = min(calibrate.DEFAULT_TUNE, held // 2)
        eta = decoding_seconds(spr, names, tune, held - tune, min(COST_SENTENCES, held - tune))
        decode_s = (eta["decode_speed"] + sum(eta["calibration"].values()) + eta["evaluation"]
                    + sum(eta["decode_cost"].values()))
        train_s = training_seconds(per, self.executor.training_slots() if self.executor is not None else None)
        total = train_s + decode_s
        reused = sum(1 for m in names if reuse.get(m))
        text = (f"≈ {minutes(total)}: training ≈ {minutes(train_s)}"
                + (f" ({reused} plug-in(s) reused)" if reused else "")
                + (f" on {self.executor.training_slots()} Ray worker(s)" if self.executor is not None else "")
                + f", calibrating and decoding ≈ {minutes(decode_s)}")
        if unmeasured:
            text += f"; no training estimate for {', '.join(unmeasured)}"
        return {"seconds": round(total, 1), "per_method": per, "text": text + "."}

    def job_rank(self, job: JobContext) -> dict:
        a = job.args
        owner = job.owner
        bb = self.backbone_svc.for_job(job)
        if a.get("build_job"):
            built = self.ctx.jobs.get(a["build_job"], owner)
            if built is None or built["state"] != "done":
                raise UserError("The demo corpus's memory was not built (its build job "
                                f"{'is ' + built['state'] if built else 'is gone'}); nothing to rank.")
            a = {**a, "memory_id": built["result"]["memory_id"]}
            job.args = a
            self.ctx.jobs._update(job.id, args=json.dumps(a, default=str))  # a resume finds the memory
        if self.backbone_svc.offsite(bb):
            raise UserError(REMOTE)
        row = self.memory_svc.memory_row(a["memory_id"], owner)
        mem = open_memory(row["path"], bb)
        if a.get("resume_of"):
            job.log(f"Resuming the ranking interrupted by a restart ({a['resume_of']}): finished plug-ins and "
                    f"calibrations are reused.")
        test = [tuple(p) for p in a["pairs"]] if a.get("pairs") else None
        trainer = self.executor.rank_trainer(self.backbone_svc.worker_spec()) if self.executor is not None else None
        with self.gate.use(holder="ranking every method"):
            job.checkpoint = self.gate.checkpoint
            board = run_rank(bb, mem, catalog=self.ctx.catalog, owner=owner, methods=a["methods"], test_pairs=test,
                             test_name=a.get("data"), progress=job.progress, should_stop=job.should_stop,
                             log=job.log, trainer=trainer, s_per_sentence=decode_s_per_sentence(bb.name))
        for m in board["methods"]:  # calibrations changed: loaded copies start from the new settings
            self.plugin_cache.pop(m.get("plugin_id"))
        return {"leaderboard": json_safe(board), "memory_id": a["memory_id"], "message": board["verdict"]}

    # --- leaderboards -------------------------------------------------------------------------------------------
    def leaderboard(self, job_id: str | None = None, *, memory_id: str | None = None,
                    owner: str | None = None) -> dict:
        """One of the owner's finished rankings (``job_id``), or the latest for ``memory_id`` (or for any memory):
        the leaderboard with ``job_id``."""
        owner = self.ctx.owner(owner)
        if job_id:
            job = self.ctx.jobs.get(str(job_id), owner)
            if job is None or job["kind"] != "rank":
                raise UserError(f"No ranking {job_id!r}.")
            if job["state"] != "done":
                raise UserError(f"This ranking has no leaderboard: it is {job['state']}.")
        else:
            job = next((j for j in self.ctx.jobs.list(kinds=("rank",), states=("done",), limit=200, owner=owner)
                        if not memory_id or (j.get("result") or {}).get("memory_id") == memory_id), None)
            if job is None:
                raise UserError("No finished ranking yet: rank the methods on a memory first.")
        return {**job["result"]["leaderboard"], "job_id": job["id"]}

    def best_methods(self, *, owner: str | None = None) -> dict[str, str]:
        """``{plug-in id: "best on <memory>: +x chrF"}`` from the owner's latest ranking of each memory (what
        Compare's method picker marks)."""
        owner = self.ctx.owner(owner)
        out, seen = {}, set()
        for j in self.ctx.jobs.list(kinds=("rank",), states=("done",), limit=200, owner=owner):
            res = j.get("result") or {}
            if res.get("memory_id") in seen:
                continue
            seen.add(res.get("memory_id"))
            board = res.get("leaderboard") or {}
            best = next((r for r in board.get("methods", []) if r.get("best")), None)
            if best and best.get("plugin_id"):
                out[best["plugin_id"]] = f"best on {board['memory']['name']}: {best['chrf_delta']:+.1f} chrF"
        return out

    # --- shares -------------------------------------------------------------------------------------------------
    def share_leaderboard(self, job_id: str, *, owner: str | None = None) -> str:
        """Store one of the owner's leaderboards for read-only viewing at ``/share/?c=<id>``; return the id. Stored:
        the rows' scores, costs and settings, the verdict, the numbers of samples, the phases' times, the backbone
        and task. Never stored: ids (plug-ins, memory, job), the memory's or test file's name, samples."""
        owner = self.ctx.owner(owner)
        board = self.leaderboard(job_id, owner=owner)
        self.ctx.limits.check_quota("shares_per_owner", self.ctx.catalog.count("comparisons", owner),
                                    "shared comparisons")
        d = board.get("data") or {}
        payload = {"kind": SHARE_KIND, "version": 2, "task": board["task"], "backbone": board["backbone"],
                   "data": {"tune": d.get("tune"), "report": d.get("report"), "report_source": d.get("report_source"),
                            "warning": d.get("warning")},
                   "memory": {"train_samples": board["memory"].get("train_samples"),
                              "entries": board["memory"].get("entries")},
                   "methods": [{k: r.get(k) for k in SHARED_ROW_KEYS} for r in board["methods"]],
                   "verdict": board["verdict"], "best": board.get("best"), "better": board.get("better"),
                   "pareto": board.get("pareto"),
                   "phases": board.get("phases"), "bootstrap": board.get("bootstrap"), "alpha": board.get("alpha"),
                   "signatures": board.get("signatures"), "created": board.get("created"), "shared": time.time()}
        if board.get("transfer"):  # a test file's transfer check and the held-out leaderboard beside it, no ids
            payload["transfer"] = {k: board["transfer"].get(k) for k in ("measure", "inputs", "heldout", "farther",
                                                                         "text")}
        if board.get("heldout"):
            h = board["heldout"]
            payload["heldout"] = {"data": h.get("data"), "verdict": h.get("verdict"),
                                  "methods": [{k: r.get(k) for k in SHARED_ROW_KEYS} for r in h["methods"]]}
        text = json.dumps(json_safe(payload), ensure_ascii=False)
        self.ctx.limits.check("share_bytes", len(text.encode("utf-8")), "The shared leaderboard's size in bytes")
        return self.ctx.catalog.save_comparison(text, backbone=board["backbone"], owner=owner)

    def shared_leaderboard(self, share_id: str) -> dict:
        """A shared leaderboard's stored payload: public to anyone with the id."""
        if not share_id or not isinstance(share_id, str) or len(share_id) > 100:
            raise UserError("This link is not valid.")
        p = self.ctx.catalog.comparison(share_id)
        if p is None or p.get("kind") != SHARE_KIND:
            raise UserError("This shared leaderboard does not exist (the link may be incomplete).")
        return p

    # --- restarts -----------------------------------------------------------------------------------------------
    def running_rankings(self) -> list[dict]:
        """Rankings a previous process left running (before ``recover`` marks them interrupted)."""
        return self.ctx.jobs.list(kinds=("rank",), states=("running",), limit=1000)

    def resume_rankings(self, jobs: list[dict]) -> list[str]:
        """Queue each interrupted ranking again (it reuses what the first run finished); its row says so."""
        out = []
        for j in jobs:
            a = dict(j.get("args") or {})
            n = int(a.get("resumes") or 0)
            if n >= MAX_RESUMES:
                continue
            a.update(resume_of=j["id"], resumes=n + 1)
            a.pop("build_job", None) if a.get("memory_id") else None
            try:
                jid = self.ctx.jobs.submit("rank", a, owner=j.get("owner") or "local")
            except UserError:
                continue
            self.ctx.jobs._update(j["id"], message=f"Interrupted by a restart; resumed as {jid}.")
            out.append(jid)
        return out
