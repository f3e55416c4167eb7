"""Teacher-forced scoring (eval.likelihood) and the paired bootstrap of eval.quality's reports."""
import json

import numpy as np
import pytest

from eval.likelihood import dev_memory, entry_steps, score_settings


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
    from eval.metrics import paired_bootstrap

    refs = [f"Das ist Satz Nummer {i} über das Wetter in der Stadt." for i in range(40)]
    bad = [f"Es regnet {i}." for i in range(40)]
    good = [r if i % 4 else "Falsch." for i, r in enumerate(refs)]
    better = paired_bootstrap(bad, good, refs, n_samples=200)
    same = paired_bootstrap(bad, list(bad), refs, n_samples=200)
    assert better["sacrebleu"]["p_value"] < 0.05 and better["chrf"]["p_value"] < 0.05
    assert same["sacrebleu"]["p_value"] > 0.5 and same["chrf"]["p_value"] > 0.5


def test_apply_config_changes_a_field_and_rejects_bad_input(tiny, tiny_memory, tmp_path):
    from eval.likelihood import apply_config
    from plugins.api import new_plugin

    p = new_plugin("pema", tiny, tiny_memory, {"rank": 8})
    apply_config(p, ['decode_vocab="full"'])
    assert p.config.decode_vocab == "full"
    from studio.errors import UserError

    for bad in ("decode_vocab=full", "no_such_field=1"):
        with pytest.raises(SystemExit):
            apply_config(p, [bad])
    with pytest.raises(UserError, match="decode_vocab"):
        apply_config(p, ['decode_vocab="neither"'])
