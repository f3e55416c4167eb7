"""Task prompts: the PEMA paper's templates (its Table 9), user templates with a ``{src}`` slot, few-shot
examples, the chat template for instruct models, and the paper's post-processing (its Table 10: keep the first
sentence line, drop what the model adds after it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ground.errors import UserError

# The PEMA paper's Table 9 templates.
PAPER_TEMPLATES = {
    "translation": "Translate this from English to German:\n{src}\nGerman:",
    "formality": "Convert the following informal sentence into a formal sentence:\nInformal: {src}\nFormal:",
    "style": "Rewrite the following sentence in the style of Shakespeare:\nModern: {src}\nShakespeare:",
}

# Few-shot friendly line formats: a base (non-instruct) model continues "English: ... / German: ..." lists far
# better than the instruction alone (on Gemma 3 270M, several sacreBLEU points better).
LIST_TEMPLATES = {
    "translation": "English: {src}\nGerman:",
    "formality": "Informal: {src}\nFormal:",
    "style": "Modern: {src}\nShakespeare:",
}

# How a monolingual target-side sample is turned into a synthetic source by the backbone itself.
REVERSE_TEMPLATES = {
    "translation": "German: {src}\nEnglish:",
    "formality": "Formal: {src}\nInformal:",
    "style": "Shakespeare: {src}\nModern:",
}

# The same for an instruct (chat) backbone: inside a user turn the completion-style templates above are not a task
# (SmolLM2-135M-Instruct answered "Shakespeare: …" with an essay on the word's etymology); an instruction that asks
# for the rewritten line only gives usable sources.
CHAT_REVERSE_TEMPLATES = {
    "translation": "Translate this German sentence into English. Reply with the translation only.\n\n{src}",
    "formality": "Rewrite this sentence as a casual, informal chat message. Reply with the message only.\n\n{src}",
    "style": "Rewrite this line from a Shakespeare play in plain, modern English. "
             "Reply with the rewritten line only.\n\n{src}",
}

TASKS = tuple(PAPER_TEMPLATES)


@dataclass
class Prompt:
    """How a source sentence becomes the model's context.

    ``template`` has one ``{src}`` slot; each few-shot example ``(src, tgt)`` is rendered as
    ``template(src) + " " + tgt`` and the examples are separated by ``separator``. ``chat`` wraps the whole
    text as one user turn with the tokenizer's chat template (instruct models); then the target follows the
    assistant header directly instead of after a space.
    """

    template: str = LIST_TEMPLATES["translation"]
    examples: list[tuple[str, str]] = field(default_factory=list)
    separator: str = "\n\n"
    chat: bool = False

    def __post_init__(self):
        if "{src}" not in self.template:
            raise UserError("A prompt template needs a {src} slot where the input sentence goes.")
        try:
            self.template.format(src="x")
        except (KeyError, IndexError, ValueError) as e:
            raise UserError(f"The prompt template has a stray brace: {e!s}. Write literal braces as {{{{ and }}}}.")
        self.examples = [tuple(e) for e in self.examples]

    @classmethod
    def for_task(cls, task: str, examples=(), paper: bool = False, chat: bool = False) -> "Prompt":
        if task not in PAPER_TEMPLATES:
            raise UserError(f"Unknown task {task!r}; choose one of {', '.join(TASKS)} or give a template.")
        tpl = PAPER_TEMPLATES[task] if paper else LIST_TEMPLATES[task]
        return cls(template=tpl, examples=list(examples), chat=chat)

    @property
    def target_prefix(self) -> str:
        """What stands between the rendered context and the target text."""
        return "" if self.chat else " "

    def render(self, src: str) -> str:
        shots = [self.template.format(src=s) + self.target_prefix + t for s, t in self.examples]
        return self.separator.join(shots + [self.template.format(src=src)])

    def to_dict(self) -> dict:
        d = asdict(self)
        d["examples"] = [list(e) for e in self.examples]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Prompt":
        return cls(**{k: d[k] for k in ("template", "examples", "separator", "chat") if k in d})


def common_prefix_len(seqs: list[list[int]]) -> int:
    """Length of the longest token prefix shared by all sequences (the instruction and few-shot examples)."""
    first = seqs[0]
    n = min(len(s) for s in seqs)
    for s in seqs[1:]:
        i = 0
        while i < n and s[i] == first[i]:
            i += 1
        n = i
    return n


def postprocess(text: str) -> str:
    """The paper's post-processing: keep the first line of the generated text, stripped."""
    return text.split("\n", 1)[0].strip()
