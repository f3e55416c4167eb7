"""One-line changes that break the leaderboard's honesty rules, each run against the rule's tests in
``tests/test_honesty_rules.py`` (a kept decode's also against ``tests/test_live_decode.py``'s slider moves;
docs/testing.md, "Honesty rules"): every one must make them fail.

Each change is made on a copy of the committed tree (``git archive HEAD``, so the working tree is never touched): the
file is copied aside, the line replaced, the tests selected by ``-k`` run, the file copied back. Prints one line per
change and a count; exits 1 when a change is missed.

    python scripts/honesty_mutations.py              # every change (about 10 min on 2 idle cores)
    python scripts/honesty_mutations.py -k kNN       # those whose rule mentions kNN
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# the rules' tests; a kept decode's rows are also guarded by the slider-move tests of test_live_decode.py, the
# verdict's and the report's boundaries by test_rank.py
TESTS = ["tests/test_honesty_rules.py", "tests/test_live_decode.py", "tests/test_rank.py"]
LIVE = "finished_early or slider_moves"

# (rule, file, the line's text, its broken text, the tests that guard it: a pytest -k expression)
CHANGES = [
    ('tuning only on the tuning part', 'eval/calibrate.py',
     'samples, _, info = split_heldout(memory, max_samples)',
     '_, samples, info = split_heldout(memory, max_samples)', 'decodes_only_the_tuning_part'),
    ('tuning only on the tuning part', 'eval/calibrate.py',
     'tune, report = held[:n_tune], held[n_tune:]',
     'tune, report = held[:n_tune], held', 'decodes_only_the_tuning_part'),
    ('tuning only on the tuning part', 'eval/rank.py',
     'report = [(s["src"], s["tgt"]) for s in rest]',
     'report = [(s["src"], s["tgt"]) for s in tune + rest]', 'decodes_only_the_tuning_part'),
    ('budget never below MIN_TUNE', 'eval/calibrate.py',
     'if budget is not None and i >= MIN_TUNE and time.time() - t0 > budget:',
     'if budget is not None and time.time() - t0 > budget:', 'budget_never'),
    ('budget never below MIN_TUNE', 'eval/calibrate.py',
     'samples = samples[:max(MIN_TUNE, int(max_samples))]',
     'samples = samples[:int(max_samples)]', 'budget_never'),
    ('the grid, not the clock (no default budget)', 'eval/calibrate.py',
     'DEFAULT_SECONDS = None',
     'DEFAULT_SECONDS = 100.0', 'without_a_budget'),
    ('global start always in the grid', 'eval/calibrate.py',
     'for g in decode_grid(type(plugin)) + [start]:',
     'for g in decode_grid(type(plugin)):', 'global_start_and_lambda'),
    ('λ = 0 always in the grid', 'eval/calibrate.py',
     '"table": rows, "n": n,',
     '"table": table, "n": n,', 'global_start_and_lambda'),
    ('evidence rule: adjusted p', 'eval/calibrate.py',
     'and r["p_vs_start_holm"] < alpha',
     'and r["p_vs_start"] < alpha', 'evidence_is_adjusted or choose_needs'),
    ('evidence rule: adjusted p', 'eval/calibrate.py',
     'for key, adj in zip(keys, holm([tests[k]["p"] for k in keys])):',
     'for key, adj in zip(keys, [tests[k]["p"] for k in keys]):', 'evidence_is_adjusted or choose_needs'),
    ('evidence rule: α', 'eval/calibrate.py',
     'ALPHA = 0.05 ',
     'ALPHA = 0.5 ', 'evidence_is_adjusted or choose_needs'),
    ('evidence rule: no sacreBLEU loss', 'eval/calibrate.py',
     ' and r["bleu_vs_start"] >= 0]',
     ']', 'choose_needs'),
    ('evidence rule: ties nearer the base', 'eval/calibrate.py',
     'return max(ok, key=lambda r: (r["chrf"], r["bleu"], -float(r["settings"][weight])))',
     'return max(ok, key=lambda r: (r["chrf"], r["bleu"], float(r["settings"][weight])))', 'choose_needs'),
    ('calibration only with its weights', 'plugins/settings.py',
     'if cal.get("weights_sha256") != _weights_sha(cfg) or cal.get("rule") != CALIBRATION_RULE:',
     'if cal.get("rule") != CALIBRATION_RULE:', 'used_only_with_its_weights'),
    ('calibration only on its backbone', 'plugins/settings.py',
     'if cal is None or cal.get("backbone") != plugin.backbone_name:',
     'if cal is None:', 'used_only_with_its_weights'),
    ('calibration only on its backbone', 'plugins/settings.py',
     'if cal is None or cal.get("backbone") != plugin.backbone_name:',
     'if cal is None or cal.get("backbone") not in (None, plugin.backbone_name):', 'used_only_with_its_weights'),
    ('calibration only by its rule', 'plugins/settings.py',
     'if cal.get("weights_sha256") != _weights_sha(cfg) or cal.get("rule") != CALIBRATION_RULE:',
     'if cal.get("weights_sha256") != _weights_sha(cfg):', 'used_only_with_its_weights'),
    ('settings precedence', 'plugins/settings.py',
     '{**tuned, **(cal or {}).get("settings", {}), **own}',
     '{**(cal or {}).get("settings", {}), **tuned, **own}', 'precedence'),
    ('settings precedence', 'plugins/settings.py',
     '{**tuned, **(cal or {}).get("settings", {}), **own}',
     '{**tuned, **own, **(cal or {}).get("settings", {})}', 'precedence'),
    ('plug-in reuse: same backbone', 'eval/rank.py',
     ' or r["fingerprint"] != fingerprint:',
     ':', 'plugin_is_reused'),
    ('plug-in reuse: identical settings', 'eval/rank.py',
     'return make_config(method, stored).to_dict() == wanted',
     'return make_config(method, stored).to_dict() is not None', 'plugin_is_reused'),
    ('calibration reuse: disjoint from report', 'eval/rank.py',
     ' and old.get("sample_ids") and set(old["sample_ids"]) == ids:',
     ' and old.get("sample_ids"):', 'reuses_a_calibration_only'),
    ('calibration reuse: disjoint from report', 'eval/rank.py',
     'set(old["sample_ids"]) == ids:',
     'set(old["sample_ids"]) >= ids:', 'reuses_a_calibration_only'),
    ('calibration reuse: this memory', 'eval/rank.py',
     'if old and old.get("memory_id") == memory.id and ',
     'if old and ', 'reuses_a_calibration_only'),
    ('prompt examples from training only', 'memories/build.py',
     '[i for i in range(len(samples)) if i not in held],',
     'list(range(len(samples))),', 'prompt_examples_come'),
    ('prompt examples from training only', 'plugins/retrieval_icl.py',
     'if s["split"] == "train" and isinstance(src, str)',
     'if isinstance(src, str)', 'retrieved_examples'),
    ('BM25 coverage recall normalised', 'plugins/retrieval_icl.py',
     'return sum(len(todo[n] & grams[c]) / total[n] for n in total) / len(total)',
     'return sum(len(todo[n] & grams[c]) for n in total) / len(total)', 'coverage_recall'),
    ('k respected (candidates)', 'plugins/retrieval_icl.py',
     'cand = self.index.top(q, max(k, settings.candidates))',
     'cand = self.index.top(q, settings.candidates)', 'k_is_respected'),
    ('k respected (coverage)', 'plugins/retrieval_icl.py',
     'while left and len(chosen) < k and',
     'while left and len(chosen) <= k and', 'k_is_respected'),
    ('kNN covariance centred', 'plugins/knn.py',
     'x = x - x.mean(0)',
     'x = x', 'centred'),
    ('projected bound shrunk', 'plugins/knn.py',
     'return approx, lower.mul_(self.shrink)',
     'return approx, lower', 'projected_lower_bound'),
    ('decode-cost row aligned', 'eval/rank.py',
     'rows[1 + names.index(m)], prompt',
     'rows[names.index(m)], prompt', 'decode_cost_is_its_own'),
    ('decode-cost row aligned', 'eval/rank.py',
     'rows_out[m]["decode_cost"] = round(cost, 2)',
     'rows_out[names[0]]["decode_cost"] = round(cost, 2)', 'decode_cost_is_its_own'),
    ('verdict: Holm-adjusted (better)', 'eval/rank.py',
     'better = sorted([r for r in others if adj[r["method"]][0] < ALPHA',
     'better = sorted([r for r in others if r[f"p_{metric}"] < ALPHA', 'verdict_claims'),
    ('verdict: Holm-adjusted (worse)', 'eval/rank.py',
     'worse = [r for r in others if adj[r["method"]][1] < ALPHA',
     'worse = [r for r in others if r[f"p_{metric}"] > 1 - ALPHA', 'verdict_claims'),
    ("Holm's step-down", 'eval/metrics.py',
     'running = max(running, min(1.0, (m - rank) * float(p)))',
     'running = min(1.0, (m - rank) * float(p))', 'holm_by_hand'),
    ("Holm's step-down", 'eval/metrics.py',
     'running = max(running, min(1.0, (m - rank) * float(p)))',
     'running = max(running, min(1.0, m * float(p)))', 'holm_by_hand'),
    ('leaderboard shows the adjusted p', 'eval/rank.py',
     'r[f"p_{k}_holm"], r[f"p_{k}_worse_holm"] = holm_adjusted(board, k)[r["method"]]',
     'r[f"p_{k}_holm"], r[f"p_{k}_worse_holm"] = r.get(f"p_{k}"), None', 'verdict_claims'),
    ('global start: not the earlier calibration', 'eval/calibrate.py',
     'start = row_settings(plugin, task, plugin.backbone_name, calibrated=False)',
     'start = row_settings(plugin, task, plugin.backbone_name, calibrated=True)', 'ignores_an_earlier'),
    ('settings precedence (global defaults switch)', 'plugins/settings.py',
     'cal = plugin_calibration(plugin) if calibrated else None',
     'cal = plugin_calibration(plugin)', 'precedence'),
    ('tuning only on the tuning part', 'eval/calibrate.py',
     'return min(DEFAULT_TUNE, heldout // 2)',
     'return min(DEFAULT_TUNE, heldout)', 'decodes_only_the_tuning_part'),
    ('projected bound shrunk', 'plugins/knn.py',
     'self.shrink = 1.0 / (1.0 + float(',
     'self.shrink = 1.0 / (1.0 + 0 * float(', 'projected_lower_bound'),
    ('kNN covariance centred', 'plugins/knn.py',
     'x = x - x.mean(0)',
     'x = x - x.mean(1, keepdim=True)', 'centred'),
    ('plug-in reuse: not a continued one', 'eval/rank.py',
     'if info.get("continued_from") or not same_config(',
     'if not same_config(', 'plugin_is_reused'),
    ('plug-in reuse: this memory', 'eval/rank.py',
     ' or r["memory_id"] != memory_id',
     '', 'plugin_is_reused'),
    ('kept-decode row aligned', 'engine/engine.py',
     'self.finished_caches.update({b: (snapshot, old[b]) for b in gone})',
     'self.finished_caches.update({b: (snapshot, b) for b in gone})', 'kept_decode or slider_moves or finished_early'),
    ('kept-decode row aligned', 'engine/engine.py',
     'return self.cache, b if self.phys is None else self.phys_list[b]',
     'return self.cache, b', 'kept_decode or slider_moves or finished_early'),
    # boundaries that one-line changes passed before their tests pinned them (docs/testing.md, "Honesty rules")
    ('verdict: a gain needs Holm p below α', 'eval/rank.py',
     'if adj[r["method"]][0] < ALPHA and r[f"{metric}_delta"] > 0]',
     'if adj[r["method"]][0] <= ALPHA and r[f"{metric}_delta"] > 0]', 'verdict_needs_p_below_alpha'),
    ('verdict: a gain needs Δ > 0', 'eval/rank.py',
     'if adj[r["method"]][0] < ALPHA and r[f"{metric}_delta"] > 0]',
     'if adj[r["method"]][0] < ALPHA and r[f"{metric}_delta"] >= 0]', 'verdict_needs_p_below_alpha'),
    ('verdict: a loss needs Holm p below α', 'eval/rank.py',
     'if adj[r["method"]][1] < ALPHA and r[f"{metric}_delta"] < 0]',
     'if adj[r["method"]][1] <= ALPHA and r[f"{metric}_delta"] < 0]', 'verdict_needs_p_below_alpha'),
    ('report needs MIN_BOOTSTRAP_N sentences, not more', 'eval/rank.py',
     'if len(report) < MIN_BOOTSTRAP_N:',
     'if len(report) <= MIN_BOOTSTRAP_N:', 'min_bootstrap_n_pairs'),
    ('a stored config that does not load is never the same', 'eval/rank.py',
     """    except (UserError, TypeError, ValueError):
        return False""",
     """    except (UserError, TypeError, ValueError):
        return True""", 'plugin_is_reused'),
    ('tuning count clamped at 0', 'eval/calibrate.py',
     'n_tune = max(0, min(int(n_tune), len(held)))',
     'n_tune = min(int(n_tune), len(held))', 'decodes_only_the_tuning_part'),
    ('evidence rule: a chrF gain', 'eval/calibrate.py',
     'and r["chrf_vs_start"] > 0 and',
     'and r["chrf_vs_start"] >= 0 and', 'evidence_is_adjusted or choose_needs'),
    ('Holm capped at 1', 'eval/metrics.py',
     'running = max(running, min(1.0, (m - rank) * float(p)))',
     'running = max(running, (m - rank) * float(p))', 'holm_by_hand'),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", default="", help="only the changes whose rule contains this text")
    args = ap.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    chosen = [c for c in CHANGES if args.k.lower() in c[0].lower()]
    missed = 0
    with tempfile.TemporaryDirectory(prefix="honesty-") as tmp:
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=repo, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        base = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, "-k",
                               f"test_honesty_rules or {LIVE}"], cwd=tmp, capture_output=True, text=True, env=env)
        if base.returncode != 0:  # a change can only be caught by tests that pass without it
            print(base.stdout[-2000:])
            print("the tests fail on the unchanged tree: nothing to check")
            return 2
        for rule, rel, old, new, select in chosen:
            path = Path(tmp) / rel
            text = path.read_text(encoding="utf-8")
            if text.count(old) != 1:
                print(f"NOT APPLIED ({text.count(old)} matches)  {rule}: {rel}: {old}")
                missed += 1
                continue
            saved = path.with_name(path.name + ".orig")
            shutil.copy(path, saved)
            try:
                path.write_text(text.replace(old, new), encoding="utf-8")
                r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *TESTS,
                                    "-k", select], cwd=tmp, capture_output=True, text=True, env=env)
            finally:
                shutil.copy(saved, path)
                saved.unlink()
            caught = r.returncode != 0
            missed += not caught
            print(f"{'caught' if caught else 'MISSED'}  {rule}: {rel}: {old!r} -> {new!r}", flush=True)
    print(f"{len(chosen) - missed} of {len(chosen)} changes caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
