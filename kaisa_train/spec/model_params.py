"""DOC_model"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import importlib.util
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from kaisa_train.registry import builtin_model_reference, model_factory, model_names
from kaisa_train.spec.bounds import Big, StrictModel
from kaisa_train.strict_numbers import NoBooleanNumbers


class ModelSpec(StrictModel):
    name: Annotated[str, Field(max_length=64)]
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the model's constructor, checked against it: "
        "unknown names, types and ranges are refused",
    )

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if builtin_model_reference(name) is not None:
            return name  # imported when built
        try:
            model_factory(name)
        except KeyError:
            raise ValueError(
                f"unknown model {name!r}; choose one of {', '.join(model_names())}, or register "
                "your own under the 'kaisa_ray.models' entry point"
            ) from None
        return name

    @model_validator(mode="after")
    def _params_fit_the_constructor(self) -> ModelSpec:
        checker = constructor_params(self.name)
        try:
            checker.model_validate(self.params)
        except ValidationError as err:
            raise ValidationError.from_exception_data(
                "ModelSpec",
                [
                    InitErrorDetails(
                        type=PydanticCustomError("model_params", message),
                        loc=("params", *where),
                        input=None,
                    )
                    for where, message in _param_problems(self.name, checker, err)
                ],
            ) from None
        return self


def _param_problems(
    model: str, checker: type[BaseModel], err: ValidationError
) -> list[tuple[tuple[str, ...], str]]:
    takes = ", ".join(checker.model_fields) or "no parameters"
    problems = []
    for item in err.errors():
        where = tuple(str(part) for part in item["loc"])
        message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            close = difflib.get_close_matches(where[0], list(checker.model_fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            message = f"model {model!r} takes no parameter {where[0]!r}{hint} (it takes: {takes})"
        else:
            message = f"{message} (checked against model {model!r}'s constructor)"
        problems.append((where or ("params",), message))
    return problems


# What a parameter without a type annotation may be: a JSON scalar of bounded size, or a short
# list of them. Nothing nested, nothing large, so that any constructor gets plain values.
_Scalar = (
    Annotated[int, Field(ge=-(2**31), le=2**31)]
    | Annotated[float, Field(ge=-Big, le=Big)]
    | Annotated[str, Field(max_length=256)]
    | bool
    | None
)


_UNTYPED = _Scalar | Annotated[list[_Scalar], Field(max_length=64)]


@functools.cache
def constructor_params(name: str) -> type[BaseModel]:
    """A pydantic model of the model ``name``'s constructor keywords (its signature and type
    annotations, ``Annotated`` bounds included; unannotated ones take bounded JSON scalars).
    A built-in model's constructor is read from its source (``source_constructor``) so that
    checking a spec imports no torch; a plugin's is its factory's."""
    reference = builtin_model_reference(name)
    target = source_constructor(reference) if reference is not None else None
    if target is None:
        factory: Callable[..., Any] = model_factory(name)
        target = factory.__init__ if isinstance(factory, type) else factory  # type: ignore[misc]
    return checker_of(name, target)


def checker_of(name: str, target: Callable[..., Any]) -> type[BaseModel]:
    """The pydantic model of ``target``'s keywords (see ``constructor_params``)."""
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # a plugin's annotations that do not resolve: check names only
        hints = {}
    fields: dict[str, Any] = {}
    for parameter in list(inspect.signature(target).parameters.values()):
        if parameter.name == "self" or parameter.kind in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
            inspect.Parameter.POSITIONAL_ONLY,
        ):
            continue
        kind = hints.get(parameter.name, _UNTYPED)
        default = ... if parameter.default is inspect.Parameter.empty else parameter.default
        fields[parameter.name] = (kind, default)
    return create_model(f"{name}_params", __base__=_Params, **fields)


def source_constructor(reference: str) -> Callable[..., None] | None:
    """The constructor of ``"module:class"`` as a function with its signature, annotations and
    defaults and no body, built from the module's source without importing the module: its
    ``__init__`` evaluated among the module's top-level imports and assignments that need no
    torch (``Width = Annotated[int, Field(...)]``). None where that cannot be done (no
    ``__init__`` of its own, a name it needs that only the module's import would define):
    the caller imports the class instead. ``tests/train/test_spec.py`` checks that every
    built-in model's is the imported class's."""
    module, attribute = reference.split(":")
    found = importlib.util.find_spec(module)
    if found is None or found.origin is None:
        return None
    tree = ast.parse(Path(found.origin).read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == attribute]
    inits = [
        n
        for c in classes
        for n in c.body
        if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    ]
    if len(inits) != 1:
        return None
    namespace: dict[str, Any] = {"__name__": f"{module}.source"}
    for statement in tree.body:
        if isinstance(statement, ast.Import | ast.ImportFrom):
            modules = [statement.module or ""] if isinstance(statement, ast.ImportFrom) else []
            modules += [alias.name for alias in getattr(statement, "names", [])]
            if any(m == "torch" or m.startswith("torch.") for m in modules):
                continue
        elif not isinstance(statement, ast.Assign | ast.AnnAssign):
            continue
        try:
            exec(compile(ast.Module([statement], []), found.origin, "exec"), namespace)
        except Exception:  # a name only the module's own import would give: not needed here
            continue
    stub = copy.copy(inits[0])  # its arguments, defaults and annotations; no body
    stub.body = [ast.Expr(ast.Constant(Ellipsis))]
    stub.decorator_list = []
    code = ast.fix_missing_locations(ast.Module([stub], []))
    try:
        exec(compile(code, found.origin, "exec", flags=_postponed(tree)), namespace)
        function: Callable[..., None] = namespace["__init__"]
        typing.get_type_hints(function, include_extras=True)
    except Exception:  # an annotation or default that needs the module itself
        return None
    return function


def _postponed(tree: ast.Module) -> int:
    """The compiler flag of ``from __future__ import annotations`` where the module has it."""
    import __future__

    for statement in tree.body:
        if (
            isinstance(statement, ast.ImportFrom)
            and statement.module == "__future__"
            and any(alias.name == "annotations" for alias in statement.names)
        ):
            return __future__.annotations.compiler_flag
    return 0


class _Params(NoBooleanNumbers):
    """The base of a model's constructor check: its keywords only, finite, no boolean
    where a number belongs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=False)
