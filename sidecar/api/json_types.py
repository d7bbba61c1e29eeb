"""JSON types of the weight and audit bodies (sidecar/api/models.py uses them): checked at the edge, passed
on unchanged.

Why: typed as plain `dict[str, Any]`, a wrong JSON type would reach code that assumes the right one, on
a rank or in the checksum package, and come back as a 500 (a list as a manifest's dtype is unhashable;
during a sync it would also tear the model) or as torch's own error (`master_host: 5` fails in the
TCPStore constructor). Each alias below validates the JSON types of its body with pydantic (strict, so
"5" is no integer and 1.0 no shape entry) and a 422 names the field, then hands the handler the JSON
exactly as it came (`_keep_json`): the handlers and the packages they call keep their own rules
(values, ranges, duplicates) and see no model objects.

`InitInfoJson` is generated from inference.transfer.groups.InitInfo's fields, its one declaration, so
a field added there is typed here too.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, WrapValidator, create_model
from pydantic_core.core_schema import ValidatorFunctionWrapHandler

from inference.transfer.groups import InitInfo


def _keep_json(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    handler(value)  # raises the ValidationError naming the field
    return value


class RecordJson(BaseModel):
    """One tensor's digest as the sender and the manifests write it (checksum.TensorRecord)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    dtype: str
    shape: list[int]
    digest: str


class ManifestJson(BaseModel):
    """A manifest (docs/checksums.md), or any object holding records under "tensors"; its other keys are
    the checksum package's to check."""

    model_config = ConfigDict(extra="allow", strict=True)
    tensors: list[RecordJson]


def _init_info_model() -> type[BaseModel]:
    hints = typing.get_type_hints(InitInfo)
    defined = {f.name: (hints[f.name], ... if f.default is dataclasses.MISSING else f.default)
               for f in dataclasses.fields(InitInfo)}
    return create_model("InitInfoJson", __config__=ConfigDict(extra="forbid", strict=True),
                        __doc__="WeightSender.init_info(): inference.transfer.groups.InitInfo as JSON", **defined)


InitInfoModel = _init_info_model()

InitInfoJson = Annotated[InitInfoModel, WrapValidator(_keep_json)]  # type: ignore[valid-type]
ExpectedJson = Annotated[list[RecordJson] | list[ManifestJson] | ManifestJson | None, WrapValidator(_keep_json)]
UpdateInfoJson = Annotated[dict[str, Any] | list[dict[str, Any] | None] | None, WrapValidator(_keep_json)]
