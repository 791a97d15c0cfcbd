"""Request and response bodies. Unknown fields and wrong types are refused (422), never coerced."""

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

# A text must hold at least one character outside whitespace, control characters and the invisible format
# characters (soft hyphen, zero-width space/joiners, bidi marks, word joiner, BOM): a text of only those is as
# blank as an empty one. The same pattern goes into the OpenAPI schema, so what the schema allows and what
# the server accepts are one definition (schemathesis checks both ways).
VISIBLE_CHARACTER = r"[^\s\x00-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u202a-\u202e\u2060-\u206f\ufeff]"
_VISIBLE = re.compile(VISIBLE_CHARACTER)


def _valid_text(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON's "\ud800" escapes decode to lone surrogates, which are not text
        raise ValueError(f"text is not valid Unicode: {e.reason} at character {e.start}") from None
    if not _VISIBLE.search(text):
        raise ValueError("text must not be empty or only whitespace or invisible characters")
    return text


Text = Annotated[str, AfterValidator(_valid_text), Field(json_schema_extra={"pattern": VISIBLE_CHARACTER})]


def _integral_float_as_int(value: object) -> object:
    # JSON Schema counts 5.0 as an integer, so the OpenAPI allows it; strict mode would refuse it. Only
    # integral floats are converted: 5.5, NaN, Infinity and strings still fail the strict int check.
    return int(value) if isinstance(value, float) and value.is_integer() else value


Count = Annotated[int, BeforeValidator(_integral_float_as_int)]


class TaskRequest(BaseModel):
    # exactly one of `text` and `texts`, stated in the schema too (neither is nullable: absent means unused)
    model_config = ConfigDict(
        extra="forbid", strict=True,
        json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["texts"]}]},
    )  # fmt: skip

    text: Text = Field(None, description="One text; use either `text` or `texts`.")  # type: ignore[assignment]
    texts: list[Text] = Field(None, min_length=1, description="Several texts, answered in order.")  # type: ignore[assignment]
    truncate: bool = Field(False, description="Cut texts over the model's n_max tokens instead of a 413.")

    @model_validator(mode="after")
    def _exactly_one_of_text_and_texts(self):
        if (self.text is None) == (self.texts is None):
            raise ValueError("send exactly one of `text` or `texts`")
        return self

    @property
    def all_texts(self) -> list[str]:
        return [self.text] if self.text is not None else list(self.texts)


class ClassifyRequest(TaskRequest):
    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [{"required": ["text"]}, {"required": ["texts"]}],
            "examples": [{"texts": ["A wonderful film.", "Two hours I will not get back."]}],
        }
    )


class ClassifyResult(BaseModel):
    label: str
    score: float = Field(description="Probability of `label`, the most likely one.")
    scores: dict[str, float] = Field(description="Softmax probability of every label.")
    tokens: int = Field(description="Tokens the model saw, BOS/EOS included.")
    truncated: bool


class ClassifyResponse(BaseModel):
    model: str
    results: list[ClassifyResult]


class TranslateRequest(TaskRequest):
    beam_size: Count = Field(1, ge=1, le=8)
    max_new_tokens: Count = Field(
        256, ge=1, le=4096,
        description="At most this many tokens per translated sentence (per text with split_sentences false; also "
                    "capped by the model's target length and by twice the sentence's tokens + 16). The tokens all "
                    "sentences x beam_size may generate must stay within the server's per-request budget "
                    "(LINFORMER_MAX_DECODE_TOKENS_PER_REQUEST), else 413.",
    )  # fmt: skip
    split_sentences: bool = Field(
        True,
        description="Translate each sentence of a text on its own and join them with the text's own spacing and line "
                    "breaks (the models were trained on single segments: a paragraph in one piece loses sentences). "
                    "Sentences end at line breaks and at . ! ? before a capital or a digit. false: each text as one "
                    "piece.",
    )  # fmt: skip


class Translation(BaseModel):
    text: str = Field(description="the German text; what the vocabulary cannot spell (emoji, other scripts) and "
                                  "web and e-mail addresses are carried over from the source as written, in order; "
                                  "the source's leading and trailing whitespace is kept")  # fmt: skip
    tokens: int


class TranslateResponse(BaseModel):
    model: str
    translations: list[Translation]


class ModelInfo(BaseModel):
    name: str
    task: str
    attention: str
    n_max: int
    k: int | None
    labels: list[str]
    execution_provider: str
    serving: bool = Field(description="False when the bundle loaded but this server cannot run its task.")


class ModelsResponse(BaseModel):
    models: list[ModelInfo]


class Readiness(BaseModel):
    ready: bool
    models: list[str] = Field(description="Models serving now.")
    not_loaded: list[str] = Field([], description="Configured models that could not be loaded (see the log).")
    draining: bool = Field(False, description="SIGTERM received: finishing accepted requests before exiting.")
    detail: str
