"""Integration tests on the real embedded default backbone (Gemma 3 270M, de-quantized once and cached)."""
import numpy as np
import pytest
import torch

from engine import Row, compare
from engine.protocol import mix_logprobs
from memories.build import build_memory, target_ids
from memories.parse import Sample
from plugins.api import train_plugin

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wmt_memory(gemma, shared_data, tmp_path_factory):
    from backbone.tasks import task_prompt
    from eval.datasets import wmt_pairs

    pairs = wmt_pairs("train", 0, 200)
    samples = [Sample(en, de, i + 1) for i, (en, de) in enumerate(pairs)]
    return build_memory(gemma, samples, tmp_path_factory.mktemp("gm") / "wmt200",
                        prompt=task_prompt("translation", gemma), batch_size=16)


def test_embedded_backbone_facts(gemma):
    assert gemma.hidden_size == 640 and gemma.vocab_size == 262144
    breaks = {i for i in gemma.stop_ids if "\n" in gemma.tokenizer.decode([i])}
    for text in ("\n", "\n\n"):  # "\n\n" ends an answer when the prompt's examples are separated by blank lines
        ids = gemma.encode_target(text)
        assert len(ids) == 1 and ids[0] in breaks, text
    assert all(set(gemma.tokenizer.decode([i])) == {"\n"} for i in breaks)  # Gemma's are pure runs of "\n"


def test_pema_learns_its_memory_and_decodes_next_to_base_and_knn(gemma, wmt_memory, tmp_path):
    """PEMA must raise the mixed probability of its memory's reference tokens (what a plug-in trained on a
    memory should do). On unseen WMT dev pairs a 200-pair memory does not help; BENCHMARKS.md reports that."""
    from eval.datasets import wmt_pairs

    assert len(wmt_memory) > 4000 and wmt_memory.key_scale > 100  # Gemma's pre-norm RMS is large
    pema, row = train_plugin(gemma, wmt_memory, "pema",
                             {"max_epochs_rct": 3, "max_epochs_joint": 10, "rank": 256, "batch_size": 64,
                              "lr": 3e-3}, out_dir=tmp_path / "pema")
    joint = pema.train_info["joint"]
    assert joint["best_heldout_loss"] < 6.0, joint  # ≈ ln(#candidates) ≈ 8.8 at initialisation
    prompt = wmt_memory.prompt
    lam = torch.tensor([0.5])  # the mixture is what decodes: P = λ·P_PEMA + (1−λ)·P_LM (GU off)
    lp_mix, lp_lm = [], []
    for en, de in wmt_pairs("train", 0, 12):
        ctx = gemma.encode_context(prompt.render(en))
        tgt = target_ids(gemma, prompt, de)
        with torch.no_grad():
            fc, _ = gemma.forward_fc(torch.tensor([ctx + tgt[:-1]]))
            fc = fc[0, len(ctx) - 1:]
            y = torch.tensor(tgt)[:, None]
            lm_all = torch.log_softmax(gemma.logits_from_fc(fc).float(), -1)
            mixed = mix_logprobs(lm_all, pema.pema_logprobs(fc), lam.expand(len(fc)))
        lp_lm.append(lm_all.gather(1, y).mean().item())
        lp_mix.append(mixed.gather(1, y).mean().item())
    assert np.isfinite(lp_mix).all()
    assert np.mean(lp_mix) > np.mean(lp_lm) + 0.2, (np.mean(lp_mix), np.mean(lp_lm))

    # And the plug-in decodes in a comparison next to the base model and kNN.
    knn, _ = train_plugin(gemma, wmt_memory, "knn", out_dir=tmp_path / "knn")
    c = compare(gemma, "The economy is growing.", [Row("base"), Row("pema", pema), Row("knn", knn)], prompt,
                max_new_tokens=24)
    assert all(r.text for r in c.rows)
    assert c.row("knn").trace[0]["neighbours"]


# --- formality on Gemma: the tuned settings neither loop nor go empty on informal chat ------------------------------
FORMALITY_INPUTS = ["gonna be late, can u send me the file asap?", "hey can u send me the file asap thx",
                    "lemme know if the package shows up", "u don't have permission to open this file lol"]


def looped(text: str, n: int = 2, times: int = 3) -> bool:
    """An output caught in a loop: one word ``n``-gram ``times`` times or more ("now its now its now its…")."""
    from collections import Counter

    words = text.lower().split()
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    return bool(grams) and max(grams.values()) >= times


def test_looped_detects_a_repeating_output():
    assert looped("now its now its now its now")
    assert not looped("I will be late; could you send me the file as soon as possible?")


@pytest.fixture(scope="module")
def formality_memory(gemma, tmp_path_factory):
    """A memory of 200 pairs of the formality demo corpus (the catalogs' English made informal)."""
    from backbone.tasks import task_prompt
    from memories.corpora import available_corpora, load_corpus

    if "formality-en" not in available_corpora():
        pytest.skip("no gettext catalogs on this machine: no formality demo corpus")
    samples = [Sample(r["src"], r["tgt"], i + 1) for i, r in enumerate(load_corpus("formality-en", limit=200))]
    return build_memory(gemma, samples, tmp_path_factory.mktemp("gm") / "formality200", task="formality",
                        prompt=task_prompt("formality", gemma), batch_size=16)


def test_formality_pema_and_knn_at_tuned_settings_neither_loop_nor_go_empty(gemma, formality_memory, tmp_path):
    """PEMA and kNN at the formality settings tuned for Gemma (plugins/tuned_defaults.json) answer informal chat
    with a non-empty line that does not loop, next to the base model, in one batch."""
    from plugins.settings import row_settings

    pema, _ = train_plugin(gemma, formality_memory, "pema",
                           {"max_epochs_rct": 3, "max_epochs_joint": 10, "rank": 256, "batch_size": 64, "lr": 3e-3},
                           out_dir=tmp_path / "pema")
    knn, _ = train_plugin(gemma, formality_memory, "knn", out_dir=tmp_path / "knn")
    rows = [Row("base"), Row("pema", pema, row_settings(pema, "formality", gemma.name, calibrated=False)),
            Row("knn", knn, row_settings(knn, "formality", gemma.name, calibrated=False))]
    assert rows[1].settings.lambda_max == 0.3 and rows[2].settings.lambda_ == 0.05  # the tuned ones
    outputs = {}
    for src in FORMALITY_INPUTS:
        c = compare(gemma, src, rows, formality_memory.prompt, max_new_tokens=48)
        outputs[src] = {r.label: r.text for r in c.rows}
    print(outputs)
    for src, out in outputs.items():
        for label, text in out.items():
            assert text.strip(), (src, label, out)  # empty-output guard
            assert not looped(text), (src, label, text)  # repetition guard
