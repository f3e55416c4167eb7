"""Integration tests on the real embedded default backbone (Gemma 3 270M, de-quantized once and cached)."""
import numpy as np
import pytest
import torch

from memories.build import build_memory, target_ids
from memories.parse import Sample
from plugins.api import train_plugin
from plugins.decode import Row, compare
from plugins.pema import mix_logprobs

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
