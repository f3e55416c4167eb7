"""The GPU's backbone menu (``studio.backbone_menu``, ``BackboneService.set_backbone``, the header's panel) on the
CPU, with CUDA's presence replaced: no menu without a GPU or in multi-user mode; on a GPU the embedded backbones and
the larger Hub ones that fit its memory, each with its precision and build batch; switching refuses what the menu
does not offer and loads the chosen one by its Hub id (unreachable here: the load fails with the reason)."""
from __future__ import annotations

import pytest

from ground.errors import UserError
from studio import backbone_menu as menus


def test_no_gpu_no_menu():
    assert menus.backbone_menu(None) == []


def test_a_gpu_offers_gemma_3_1b_in_bfloat16_with_larger_build_batches():
    menu = {e["name"]: e for e in menus.backbone_menu(80.0)}
    assert {"gemma-3-270m", "smollm2-135m-instruct", "google/gemma-3-1b-pt", "google/gemma-3-1b-it"} <= set(menu)
    one_b = menu["google/gemma-3-1b-pt"]
    assert one_b["hub"] and one_b["dtype"] == "bfloat16" and one_b["build_batch_size"] == 32
    assert not menu["gemma-3-270m"]["hub"] and menu["gemma-3-270m"]["build_batch_size"] == 8
    assert menus.build_batch_size("google/gemma-3-1b-it") == 32
    assert menus.build_batch_size("gemma") == menus.build_batch_size("tiny") == 8


def test_a_small_gpu_offers_only_what_fits():
    names = [e["name"] for e in menus.backbone_menu(4.0)]
    assert "gemma-3-270m" in names and not any(n.startswith("google/") for n in names)


@pytest.fixture()
def studio(tmp_path, monkeypatch):
    from studio.service import Studio

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the Hub path is kept but cannot be reached here
    st = Studio(tmp_path / "data", backbone="tiny")
    assert st.backbone_service.wait_ready(60)
    yield st
    st.close()


def test_the_studio_offers_the_menu_only_on_a_gpu(studio, monkeypatch):
    monkeypatch.setattr(menus, "cuda_memory_gib", lambda: None)
    assert studio.backbone_service.backbone_menu() == []
    with pytest.raises(UserError, match="offered on a GPU machine"):
        studio.backbone_service.set_backbone("google/gemma-3-1b-pt")
    monkeypatch.setattr(menus, "cuda_memory_gib", lambda: 80.0)
    menu = studio.backbone_service.backbone_menu()
    assert "google/gemma-3-1b-pt" in [e["name"] for e in menu] and not any(e["current"] for e in menu)
    with pytest.raises(UserError, match="Not in this studio's backbone menu"):
        studio.backbone_service.set_backbone("someone/huge-model")
    # a refusal changes nothing
    assert studio.backbone_service.status()["ready"] and studio.backbone_service.backbone_name == "tiny"


def test_switching_loads_the_hub_backbone_in_its_precision(studio, monkeypatch):
    monkeypatch.setattr(menus, "cuda_memory_gib", lambda: 80.0)
    studio.backbone_service.set_backbone("google/gemma-3-1b-pt")
    bs = studio.backbone_service
    assert bs.backbone_name == "google/gemma-3-1b-pt" and bs.dtype == "bfloat16"
    assert not studio.backbone_service.wait_ready(120)  # offline here: the Hub id cannot load, and the header says why
    st = studio.backbone_service.status()
    assert st["state"] == "failed" and "google/gemma-3-1b-pt" in st["message"]
    assert [e["name"] for e in studio.backbone_service.backbone_menu() if e["current"]] == ["google/gemma-3-1b-pt"]


def test_a_hosted_studio_has_no_menu(tmp_path, monkeypatch):
    from studio.service import Studio

    monkeypatch.setattr(menus, "cuda_memory_gib", lambda: 80.0)
    st = Studio(tmp_path / "hosted", backbone="tiny", multi_user=True, load=False, start_jobs=False)
    try:
        assert st.backbone_service.backbone_menu() == []
        with pytest.raises(UserError):
            st.backbone_service.set_backbone("google/gemma-3-1b-pt", owner="someone")
    finally:
        st.close()


def _visible(demo, elem_id: str) -> bool:
    block = next(b for b in demo.blocks.values() if getattr(b, "elem_id", None) == elem_id)
    return bool(block.visible)


def test_the_header_shows_the_menu_only_on_a_gpu(studio, monkeypatch):
    from ui.app import backbone_choices, build_app

    monkeypatch.setattr(menus, "cuda_memory_gib", lambda: None)
    assert not _visible(build_app(studio), "pema-backbone-menu")
    monkeypatch.setattr(menus, "cuda_memory_gib", lambda: 80.0)
    assert _visible(build_app(studio), "pema-backbone-menu")
    choices, current = backbone_choices(studio.backbone_service.backbone_menu())
    assert ("Gemma 3 1B (pre-trained), multilingual · 1.0B (google/gemma-3-1b-pt)", "google/gemma-3-1b-pt") in choices
    assert current is None  # the tiny test backbone is not on the menu


def test_the_repository_holds_gemma_3_1b_shapes_for_the_gpu_benchmark():
    """``python -m benchmarks gpu --config-dir gemma-3-1b``: the config is Gemma 3 1B's (999.9 M parameters), with no
    tokenizer of its own (the benchmark takes the embedded 270M's)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.gpu import CONFIGS, has_tokenizer

    cfg = AutoConfig.from_pretrained(CONFIGS / "gemma-3-1b")
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size,
            cfg.sliding_window) == ("gemma3_text", 1152, 26, 4, 1, 256, 6912, 262144, 512)
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [5, 11, 17, 23]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 999.9
    assert not has_tokenizer(CONFIGS / "gemma-3-1b")
