"""Teacher-forced scoring (eval.likelihood) and the paired bootstrap of eval.quality's reports."""
import json

import numpy as np
import pytest

from eval.likelihood import FullMix, dev_memory, entry_steps, score_settings


def test_entry_steps_count_positions_within_each_sample():
    assert entry_steps(np.array([0, 0, 0, 3, 3, 5])).tolist() == [0, 1, 2, 0, 1, 0]
    assert entry_steps(np.array([], dtype=np.int32)).tolist() == []


@pytest.fixture(scope="module")
def scored(tiny, tiny_memory, tiny_pairs, tmp_path_factory):
    from plugins.api import train_plugin

    root = tmp_path_factory.mktemp("cache")
    pema, _ = train_plugin(tiny, tiny_memory, "pema", {"rank": 16, "max_epochs_rct": 3, "max_epochs_joint": 30,
                                                       "softmax": "full", "patience": 30, "dropout": 0.0},
                           out_dir=root / "pema")
    mem = dev_memory(tiny, tiny_memory.prompt, tiny_pairs[:4], root, "translation")
    again = dev_memory(tiny, tiny_memory.prompt, tiny_pairs[:4], root, "translation")
    steps = entry_steps(mem.entry_sample)
    src_lens = np.array([len(tiny.encode_target(s["src"])) for s in mem.samples])[np.asarray(mem.entry_sample)]
    grid = [{"lambda_max": 0.0, "gu": False}, {"lambda_max": 0.5, "gu": True}, {"lambda_max": 1.0, "gu": False}]
    rows = score_settings(tiny, pema, mem.keys, mem.values, steps, src_lens, grid)
    return mem, again, rows


def test_dev_memory_is_cached_and_has_every_pair(scored):
    mem, again, _ = scored
    assert again.path == mem.path
    assert len(mem.samples) == 4 and mem.meta["stats"]["heldout_entries"] == 0


def test_score_settings_base_equals_lambda_zero_and_trained_pema_fits_its_training_pairs(scored):
    _, _, rows = scored
    base, lam0, gu, lam1 = rows
    assert base["label"] == "base" and json.loads(lam1["label"]) == {"lambda_max": 1.0, "gu": False}
    assert lam0["nll"] == pytest.approx(base["nll"], abs=1e-3) and lam0["top1"] == base["top1"]
    # These pairs are in PEMA's training memory: P_PEMA alone must model them better than the random tiny LM.
    assert lam1["nll"] < base["nll"] - 0.5
    assert min(lam1["nll"], base["nll"]) <= gu["nll"] <= max(lam1["nll"], base["nll"]) + 1e-6


def test_paired_bootstrap_separates_a_real_gain_from_chance():
    from eval.metrics import bleu_chrf, paired_bootstrap

    refs = [f"Das ist Satz Nummer {i} über das Wetter in der Stadt." for i in range(40)]
    bad = [f"Es regnet {i}." for i in range(40)]
    good = [r if i % 4 else "Falsch." for i, r in enumerate(refs)]
    better = paired_bootstrap(bad, good, refs, n_samples=200)
    same = paired_bootstrap(bad, list(bad), refs, n_samples=200)
    assert better["sacrebleu"]["p_value"] < 0.05 and better["chrf"]["p_value"] < 0.05
    assert same["sacrebleu"]["p_value"] > 0.5 and same["chrf"]["p_value"] > 0.5
    # Δ is the corpus difference; a gain under one chrF point on every sentence is as certain as a large one
    refs = [f"Das ist Satz Nummer {i} über das Wetter in der Stadt und auf dem Land, am Morgen wie am Abend, im "
            f"Sommer wie im Winter." for i in range(20)]
    base, sys_ = [r[:-12] for r in refs], [r[:-11] for r in refs]
    small = paired_bootstrap(base, sys_, refs, n_samples=200)
    assert small["chrf"]["delta"] == round(bleu_chrf(sys_, refs)["chrf"] - bleu_chrf(base, refs)["chrf"], 2)
    assert 0 < small["chrf"]["delta"] < 1 and small["chrf"]["p_value"] == 0.0


def test_apply_config_changes_a_field_and_rejects_bad_input(tiny, tiny_memory, tmp_path):
    from eval.likelihood import apply_config
    from plugins.api import new_plugin

    p = new_plugin("pema", tiny, tiny_memory, {"rank": 8})
    apply_config(p, ['decode_vocab="full"'])
    assert p.config.decode_vocab == "full"
    from ground.errors import UserError

    for bad in ("decode_vocab=full", "no_such_field=1"):
        with pytest.raises(SystemExit):
            apply_config(p, [bad])
    with pytest.raises(UserError, match="decode_vocab"):
        apply_config(p, ['decode_vocab="neither"'])


def test_interpolated_scores_equal_mixing_the_whole_vocabulary():
    import torch

    from engine.protocol import mix_logprobs
    from eval.likelihood import interpolated_scores

    g = torch.Generator().manual_seed(0)
    n, V = 64, 500
    lm = torch.log_softmax(torch.randn(n, V, generator=g) * 3, 1)
    dense = torch.log_softmax(torch.randn(n, V, generator=g) * 3, 1)
    sparse = torch.full((n, V), float("-inf"))  # kNN-like: mass on a few tokens only
    sparse[:, :5] = torch.log_softmax(torch.randn(n, 5, generator=g), 1)
    y = torch.randint(0, V, (n,), generator=g)
    for plp in (dense, sparse):
        for lam in (0.0, 0.3, 0.7, 1.0):
            lams = torch.full((n,), lam)
            full = mix_logprobs(lm, plp, lams)
            for k in (1, 3, 16):
                [(logp_y, pred)] = interpolated_scores(lm, plp, [lams], y, top_k=k)
                assert torch.allclose(logp_y, full.gather(1, y[:, None])[:, 0], equal_nan=True)
                assert torch.equal(pred, full.argmax(1))
    # The mixture's argmax can be neither side's top token: P_LM (.5, .45, .05), P_plugin (.05, .45, .5), λ .5 mix
    # to (.275, .45, .275). With top_k=1 the candidates are tokens 0 and 2, the bound exposes them, the full mix runs.
    lm3 = torch.tensor([[0.5, 0.45, 0.05]]).log()
    pl3 = torch.tensor([[0.05, 0.45, 0.5]]).log()
    [(_, pred), (_, pred_lm)] = interpolated_scores(lm3, pl3, [torch.tensor([0.5]), torch.tensor([0.0])],
                                                    torch.tensor([1]), top_k=1)
    assert pred.tolist() == [1] and pred_lm.tolist() == [0]


def test_score_settings_of_knn_match_its_full_mix(tiny, tiny_memory, tiny_pairs, tmp_path):
    from plugins.api import train_plugin

    knn, _ = train_plugin(tiny, tiny_memory, "knn", {}, out_dir=tmp_path / "knn")
    mem = dev_memory(tiny, tiny_memory.prompt, tiny_pairs[:4], tmp_path, "translation")
    steps = entry_steps(mem.entry_sample)
    src_lens = np.array([len(tiny.encode_target(s["src"])) for s in mem.samples])[np.asarray(mem.entry_sample)]
    grid = [{"k": k, "temperature": t, "lambda": lam} for k in (1, 4) for t in (1.0, 10.0) for lam in (0.2, 0.9)]

    fast = score_settings(tiny, knn, mem.keys, mem.values, steps, src_lens, grid)
    full = score_settings(tiny, FullMix(knn), mem.keys, mem.values, steps, src_lens, grid)
    assert [r["top1"] for r in fast] == [r["top1"] for r in full]
    assert [r["nll"] for r in fast] == pytest.approx([r["nll"] for r in full], abs=1e-4)
    assert len({r["nll"] for r in fast}) > 2  # the settings differ: the comparison is not vacuous
    # several plug-ins in one pass (the LM head shared) score as each does alone
    from eval.likelihood import score_plugins

    pema, _ = train_plugin(tiny, tiny_memory, "pema", {"rank": 8, "max_epochs_rct": 1, "max_epochs_joint": 2},
                           out_dir=tmp_path / "pema")
    pema_grid = [{"lambda_max": 0.5, "gu": True}, {"lambda_max": 0.9, "gu": False}]
    both = score_plugins(tiny, [(knn, grid), (pema, pema_grid)], mem.keys, mem.values, steps, src_lens)
    assert both[0] == fast
    assert both[1] == score_settings(tiny, pema, mem.keys, mem.values, steps, src_lens, pema_grid)


def test_best_likelihood_setting_prefers_top1_then_lower_nll():
    from eval.likelihood import best_likelihood_setting

    rows = [{"settings": {}, "top1": 0.9, "nll": 0.1},  # the base row is never chosen
            {"settings": {"a": 1}, "top1": 0.5, "nll": 2.0}, {"settings": {"a": 2}, "top1": 0.6, "nll": 3.0},
            {"settings": {"a": 3}, "top1": 0.6, "nll": 2.5}]
    assert best_likelihood_setting(rows) == {"a": 3}


def test_quality_tune_decode_teacher_forced_tunes_interpolating_plugins_only(tiny, tiny_memory, tiny_pairs,
                                                                             tmp_path, monkeypatch):
    import argparse
    from types import SimpleNamespace

    from eval import quality
    from eval.likelihood import best_likelihood_setting
    from plugins.api import new_plugin, train_plugin
    from plugins.pema import PEMA
    from plugins.settings import decode_grid

    pema, _ = train_plugin(tiny, tiny_memory, "pema", {"rank": 8, "max_epochs_rct": 1, "max_epochs_joint": 2},
                           out_dir=tmp_path / "pema")
    adapter = new_plugin("adapter", tiny, tiny_memory, {})
    monkeypatch.setattr(quality, "task_pairs", lambda task, split, start, n: tiny_pairs[start:start + n])
    args = argparse.Namespace(task="translation", tune_likelihood="0:3", batch=2)
    tuned, tables = quality.tune_decode(args, tiny, SimpleNamespace(root=tmp_path), {"pema": pema, "adapter": adapter},
                                        tiny_memory.prompt, tune_pairs=[], tune_extra=None)
    assert [r["label"] for r in tables["pema"]][0] == "base"
    assert len(tables["pema"]) == 1 + len(decode_grid(PEMA, fine=True))
    assert tuned["pema"] == best_likelihood_setting(tables["pema"])
    assert tuned["adapter"] == {} and tables["adapter"] == []  # nothing to tune: no decode was spent on it
