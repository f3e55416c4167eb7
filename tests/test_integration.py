"""Integration tests on the real embedded default backbone (Gemma 3 270M, de-quantized once and cached)."""
import numpy as np
import pytest
import torch

from memories.build import build_memory, target_ids
from memories.parse import Sample
from plugins.api import train_plugin
from plugins.decode import Row, compare

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wmt_memory(gemma, shared_data, tmp_path_factory):
    from eval.datasets import wmt_pairs
    from eval.tasks import task_prompt

    pairs = wmt_pairs("train", 0, 200)
    samples = [Sample(en, de, i + 1) for i, (en, de) in enumerate(pairs)]
    return build_memory(gemma, samples, tmp_path_factory.mktemp("gm") / "wmt200",
                        prompt=task_prompt("translation", gemma), batch_size=16)


def test_embedded_backbone_facts(gemma):
    assert gemma.hidden_size == 640 and gemma.vocab_size == 262144
    assert gemma.tokenizer.decode([next(iter(gemma.stop_ids - {gemma.tokenizer.eos_token_id}))]) == "\n"


def test_pema_raises_reference_probability_on_heldout_dev_pairs(gemma, wmt_memory, tmp_path):
    from eval.datasets import wmt_pairs

    assert len(wmt_memory) > 4000 and wmt_memory.key_scale > 100  # Gemma's pre-norm RMS is large
    pema, row = train_plugin(gemma, wmt_memory, "pema", {"max_epochs_rct": 3, "max_epochs_joint": 4, "rank": 256},
                             out_dir=tmp_path / "pema")
    prompt = wmt_memory.prompt
    lp_pema, lp_lm = [], []
    for en, de in wmt_pairs("dev", 0, 20):
        ctx = gemma.encode_context(prompt.render(en))
        tgt = target_ids(gemma, prompt, de)
        with torch.no_grad():
            fc, _ = gemma.forward_fc(torch.tensor([ctx + tgt[:-1]]))
            fc = fc[0, len(ctx) - 1:]
            y = torch.tensor(tgt)[:, None]
            lm = torch.log_softmax(gemma.logits_from_fc(fc), -1).gather(1, y)
            pl = pema.pema_logprobs(fc).gather(1, y)
        lp_lm.append(lm.mean().item())
        lp_pema.append(pl.mean().item())
    assert np.mean(lp_pema) > np.mean(lp_lm), (np.mean(lp_pema), np.mean(lp_lm))

    # And the plug-in decodes in a comparison next to the base model and kNN.
    knn, _ = train_plugin(gemma, wmt_memory, "knn", out_dir=tmp_path / "knn")
    c = compare(gemma, "The economy is growing.", [Row("base"), Row("pema", pema), Row("knn", knn)], prompt,
                max_new_tokens=24)
    assert all(r.text for r in c.rows)
    assert c.row("knn").trace[0]["neighbours"]
