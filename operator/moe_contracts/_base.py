"""The pydantic base of every contract model: camelCase on the wire, frozen, strict types."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Strict, ValidationError
from pydantic.alias_generators import to_camel

from .errors import check_kind_version, from_validation_error, loads_document

# Strict scalars: a JSON bool is not a number, a string is not a number (pydantic's lax mode would
# take "2" and true); a float field still takes an integer (JSON writes 1.0 as 1 at times).
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Str = Annotated[str, Strict()]
Bool = Annotated[bool, Strict()]


class Doc(BaseModel):
    """Fields are snake_case in Python and camelCase in JSON; readers ignore fields they do not
    know (additions are backward compatible, docs/contracts.md)."""

    model_config = ConfigDict(
        frozen=True, alias_generator=to_camel, populate_by_name=True, extra="ignore"
    )


M = TypeVar("M", bound=BaseModel)


def validate(document: str, model: type[M], obj: Any) -> M:
    """``model.model_validate(obj)``; a ValidationError becomes a DocumentError naming the field."""
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise from_validation_error(document, exc) from None


def read_document(
    kind: str, versions: tuple[int, ...], model: type[M], text: str | bytes | dict[str, Any]
) -> tuple[dict[str, Any], M]:
    """JSON text (or an already decoded object) of document ``kind`` -> (the document, its model):
    kind and version checked first, then the model; raises DocumentError naming the field."""
    doc = text if isinstance(text, dict) else loads_document(kind, text)
    check_kind_version(kind, doc, versions)
    return doc, validate(kind, model, doc)
