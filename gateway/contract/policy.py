"""The sampling-mask contract (docs/sglang-contract.md section 8), as plain functions.

No I/O and no HTTP library here: the proxy hands in the route kind and the parsed body,
and gets back None (forward the original bytes) or a `Rejection` to answer with.

Why the rule exists: `top_p` bounds probability mass, not the number of tokens, so a
mask for top-p-only sampling can approach the whole vocabulary per output token and
blow up response metadata and memory. A finite `top_k` is the safety cap.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias, assert_never

from gateway.contract.lax import TOP_K_ALL, Invalid, is_greedy, lax_bool, lax_int, plain_int
from gateway.contract.profiles import FINITE_TOP_K_MESSAGE, LEGACY, MaskItem, MaskProfile
from gateway.contract.routes import Kind
from gateway.contract.shapes import first_of, length_of

# SGLang 0.5.19 (PR #35205), the exact text clients and SGLang's own tests look for.
MASK_MESSAGE: Final = FINITE_TOP_K_MESSAGE
META_INFO_MESSAGE: Final = "return_sampling_mask requires return_meta_info=true."
STREAM_META_INFO_MESSAGE: Final = (
    "return_meta_info is not supported with streaming. "
    "Please set stream=false when using return_meta_info=true."
)
PARALLEL_LIST_MESSAGE: Final = (
    "return_sampling_mask must be a single bool, not a list, with parallel sampling (n > 1)."
)


@dataclass(frozen=True, slots=True)
class Rejection:
    """A reply the gateway makes itself instead of forwarding.

    `rule` (the rule that refused: sampling_mask, parallel_sampling, request_body, auth) and
    `reason` are short fixed strings: they become metric labels and the access log's
    outcome, so they must never carry request data.
    """

    status: int
    rule: str
    reason: str
    message: str
    # SGLang answers body-validation failures in the OpenAI shape on every route, and
    # rule failures in the route's own shape; True selects the former.
    validation: bool = False
    # For the log only (under the request id), never sent: e.g. the JSON parser's own words.
    detail: str = ""
    # The backend profile whose admission refused (gateway/contract/profiles.py), for
    # mask refusals; "" for rules that hold for every backend.
    profile: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class MaskDemand:
    """A body that asks for sampling masks: whether it is served depends on the backend.

    `items` are the mask items in the order SGLang's scheduler checks them; each backend's
    profile judges them. A refusal every release makes never gets here: `assess` answers it
    before any profile is asked.
    """

    items: tuple[MaskItem, ...]

    def verdict(self, profile: MaskProfile) -> Rejection | None:
        for item in self.items:
            refused = profile.refusal(item)
            if refused is not None:
                reason, message = refused
                return Rejection(400, SAMPLING_MASK, reason, message, profile=profile.name)
        return None


# What reading a body decides: None (any backend serves it), a refusal every backend would
# make, or a mask demand that each backend's profile decides.
Verdict: TypeAlias = Rejection | MaskDemand | None


def resolve(verdict: Verdict, profile: MaskProfile = LEGACY) -> Rejection | None:
    """A verdict as one backend of `profile` would have it (0.5.19's rule by default)."""
    return verdict.verdict(profile) if isinstance(verdict, MaskDemand) else verdict


def _invalid(exc: Invalid) -> Rejection:
    return Rejection(400, "request_body", "invalid_field", str(exc), validation=True)


def _top_k_range(k: int) -> Rejection | None:
    # SGLang's SamplingParams.verify(): -1 is "disable", anything else below 1 is an error.
    if k < 1 and k != -1:
        return Rejection(
            400,
            SAMPLING_MASK,
            "invalid_top_k",
            f"top_k must be -1 (disable) or at least 1, got {k}.",
        )
    return None


# The top-level fields each kind's check reads (None: all of them). The body reader
# converts only these, so they must name every field the checks below look at:
# tests/contract/test_jsonview.py runs the truth tables through a recording body to hold them to it.
_OPENAI_READS: Final = frozenset(
    {"return_sampling_mask", "return_meta_info", "stream", "n", "temperature", "top_k"}
    | {"top_p", "rid", "model", "lora_path"}  # the last two: the adapter it names
)
READS: Final[Mapping[Kind, frozenset[str] | None]] = {
    Kind.GENERATE: frozenset(
        {"return_sampling_mask", "sampling_params", "text", "input_ids", "input_embeds", "rid"}
        | {"lora_path"}
    ),
    Kind.VERTEX: None,
    Kind.CHAT: _OPENAI_READS,
    Kind.COMPLETIONS: _OPENAI_READS,
    Kind.RESPONSES: _OPENAI_READS,
}


def request_ids(body: Mapping[str, Any]) -> list[str]:
    """SGLang's own request ids in a body (`rid`: a string, or one per item of a batch), for
    routing an abort to the backend that serves them. Anything else is no id."""
    rid = body.get("rid")
    if isinstance(rid, str):
        return [rid]
    if isinstance(rid, list):
        return [r for r in rid if isinstance(r, str)]
    return []


# Fields read only for their length and the kind of their first element (the batch shape,
# `_batch_size`): 100k-token input_ids need not become 100k Python ints.
SHAPE_ONLY: Final = frozenset({"input_ids", "input_embeds"})


class Mode(enum.Enum):
    """How a rule that can be tried out acts on what it would refuse."""

    ENFORCE = "enforce"
    LOG_ONLY = "log_only"  # counted and logged, then forwarded


@dataclass(frozen=True, slots=True)
class SamplingMaskRule:
    """The sampling-mask contract (docs/sglang-contract.md s.8), as configured."""

    mode: Mode = Mode.ENFORCE
    # A top_k the operator knows the backend fills in for an omitted one (the model's
    # generation_config on chat, --preferred-sampling-params on /generate). None: fail closed.
    default_top_k: int | None = None


@dataclass(frozen=True, slots=True)
class ParallelSampleCap:
    """Parallel samples (`n`) per item. SGLang builds per-sample state for batch x n up
    front, so one request with a huge n exhausts the server's memory. None: no cap."""

    max_n: int | None = None

    def check(self, params: Mapping[str, Any], *, generate: bool) -> Rejection | None:
        if self.max_n is None:
            return None
        n = _sample_count(params.get("n"), generate=generate)
        if n is not None and n > self.max_n:
            return Rejection(
                400,
                PARALLEL_SAMPLING,
                "n_too_large",
                f"n must be at most {self.max_n} (this gateway's cap on parallel "
                f"samples per request); got {n}.",
            )
        return None


SAMPLING_MASK: Final = "sampling_mask"
PARALLEL_SAMPLING: Final = "parallel_sampling"


@dataclass(frozen=True, slots=True)
class BodyRules:
    """Every rule a parsed body is checked against, each with its own settings and mode."""

    mask: SamplingMaskRule = SamplingMaskRule()
    samples: ParallelSampleCap = ParallelSampleCap()
    # The admission `check` applies; with capability routing the proxy takes `assess` and
    # applies each backend's own profile instead.
    profile: MaskProfile = LEGACY

    def mode_of(self, rejection: Rejection) -> Mode:
        """Whether the rule that refused is enforced or only tried out (the mask rule can
        run log_only; every other refusal is always enforced)."""
        return self.mask.mode if rejection.rule == SAMPLING_MASK else Mode.ENFORCE

    def check(self, kind: Kind, body: Mapping[str, Any]) -> Rejection | None:
        """Apply the contract, with this rule set's profile, to a parsed body of a route of
        the given kind."""
        verdict = self.assess(kind, body)
        if isinstance(verdict, MaskDemand):
            return verdict.verdict(self.profile)
        return verdict

    def assess(self, kind: Kind, body: Mapping[str, Any]) -> Verdict:
        """Read a parsed body once: None (any backend serves it), a Rejection every backend
        would make, or the MaskDemand each backend's profile decides."""
        items: list[MaskItem] = []
        then: Rejection | None
        try:
            # Every kind is named: a new one fails the type check here instead of falling
            # through to "forward unchecked".
            match kind:
                case Kind.GENERATE:
                    then = self._check_generate(body, items, batch_size=_batch_size(body))
                case Kind.VERTEX:
                    then = self._check_vertex(body, items)
                case Kind.CHAT:
                    then = self._check_openai(body, items, chat=True)
                case Kind.COMPLETIONS | Kind.RESPONSES:
                    then = self._check_openai(body, items, chat=False)
                case Kind.PASSTHROUGH | Kind.CONTROL | Kind.REGISTRY | Kind.GATEWAY:
                    return None  # never inspected: forwarded, fanned out or answered, as it is
                case _:
                    assert_never(kind)
        except Invalid as exc:
            then = _invalid(exc)
        if then is not None or not items:
            # SGLang validates every item's parameters before its scheduler judges any mask,
            # so a refusal every release makes comes first.
            return then
        return MaskDemand(tuple(items))

    # -- /generate -------------------------------------------------------------------

    def _check_generate(
        self,
        body: Mapping[str, Any],
        items: list[MaskItem],
        batch_size: int | None,
        *,
        raw: bool = False,
    ) -> Rejection | None:
        """batch_size None: a single request; else the number of batch items.

        raw: the fields never went through pydantic (/vertex_generate), so SGLang reads the
        mask with plain Python truthiness rather than pydantic's lax booleans.
        """
        read_flag = _truthy if raw else lax_bool
        raw_mask = body.get("return_sampling_mask")
        params = body.get("sampling_params")
        if params is not None and not isinstance(params, dict | list):
            raise Invalid("sampling_params", "must be an object or a list of objects")
        param_list: Sequence[Any] = params if isinstance(params, list) else [params]
        for i, p in enumerate(param_list):
            if p is not None and not isinstance(p, dict):
                raise Invalid(f"sampling_params[{i}]", "must be an object")

        flags: list[bool]
        if isinstance(raw_mask, list):
            values = [read_flag(v, f"return_sampling_mask[{i}]") for i, v in enumerate(raw_mask)]
            if any(_parallel(p) for p in param_list):
                return Rejection(400, SAMPLING_MASK, "parallel_mask_list", PARALLEL_LIST_MESSAGE)
            # On a single request any non-empty list is truthy in SGLang, even [false].
            flags = [bool(values)] if batch_size is None else [bool(v) for v in values]
            broadcast = batch_size is None
        else:
            flags = [bool(read_flag(raw_mask, "return_sampling_mask"))]
            broadcast = True

        if batch_size is None and isinstance(params, list) and params and _parallel(params[0]):
            # Parallel samples turn a single request into a batch of one (SGLang's
            # _handle_parallel_sampling): only the first params are ever read.
            batch_size = 1
        if batch_size == 0:
            return None  # an empty batch runs nothing: SGLang answers []
        if broadcast and not isinstance(params, list):
            return self._check_item(params or {}, items, mask_on=flags[0], generate=True)
        # Every (item, params) pairing SGLang could make is checked. Where list lengths
        # disagree SGLang fails or broadcasts, so a missing flag counts as "any flag on" and
        # missing params as {} (unbounded): over-refusing a malformed batch is the safe side.
        any_on = any(flags)
        if batch_size is not None:
            # SGLang pairs the first batch_size flags and params with the items; extra ones
            # are never read.
            n_items = batch_size
        else:
            n_items = max(1, len(param_list), 1 if broadcast else len(flags))
        for i in range(n_items):
            flag = flags[0] if broadcast else (flags[i] if i < len(flags) else any_on)
            p = param_list[i] if i < len(param_list) else None
            if not isinstance(params, list):
                p = params
            rejection = self._check_item(p or {}, items, mask_on=flag, generate=True)
            if rejection is not None:
                return rejection
        return None

    def _check_vertex(self, body: Mapping[str, Any], items: list[MaskItem]) -> Rejection | None:
        # SGLang calls GenerateReqInput(**inputs, **parameters) itself, where inputs is the
        # first of text/input_ids/input_embeds that instances[0] has, as a list over the
        # instances. No pydantic runs on that call: values keep their JSON types.
        instances = body.get("instances")
        if not isinstance(instances, list):
            raise Invalid("instances", "Input should be a valid list")
        if not instances:
            return None  # SGLang answers [] without running anything
        if not all(isinstance(instance, dict) for instance in instances):
            raise Invalid("instances", "Input should be a list of objects")
        parameters = body.get("parameters")
        if parameters is None:
            return None
        if not isinstance(parameters, dict):
            raise Invalid("parameters", "Input should be a valid dictionary")
        fields = dict(parameters)
        for key in ("text", "input_ids", "input_embeds"):
            if instances and instances[0].get(key):
                fields.setdefault(key, [instance.get(key) for instance in instances])
                break
        size = _batch_size(fields, raw=True)
        if size is None and not any(k in fields for k in ("text", "input_ids", "input_embeds")):
            size = max(len(instances), 1)  # no input at all: SGLang fails; check every pairing
        return self._check_generate(fields, items, batch_size=size, raw=True)

    # -- OpenAI-compatible routes ------------------------------------------------------

    def _check_openai(
        self, body: Mapping[str, Any], items: list[MaskItem], *, chat: bool
    ) -> Rejection | None:
        # top_k, temperature and the mask flag are top-level fields here (extra_body is
        # merged by the SDK); a literal "sampling_params" or "extra_body" key is ignored
        # by SGLang and so by the gateway.
        mask_on = bool(lax_bool(body.get("return_sampling_mask"), "return_sampling_mask"))
        if mask_on and chat:
            # SGLang's chat serving layer checks these before the sampling params and the
            # scheduler's admission, so its answer names them first.
            if not lax_bool(body.get("return_meta_info"), "return_meta_info"):
                return Rejection(400, SAMPLING_MASK, "missing_meta_info", META_INFO_MESSAGE)
            if lax_bool(body.get("stream"), "stream"):
                return Rejection(400, SAMPLING_MASK, "stream_meta_info", STREAM_META_INFO_MESSAGE)
        return self._check_item(body, items, mask_on=mask_on, generate=False)

    # -- one item ----------------------------------------------------------------------

    def _check_item(
        self, params: Mapping[str, Any], items: list[MaskItem], *, mask_on: bool, generate: bool
    ) -> Rejection | None:
        """Check one item; a mask item joins `items`, judged later by each profile."""
        capped = self.samples.check(params, generate=generate)
        if capped is not None:
            return capped
        greedy = is_greedy(params.get("temperature"), lax=not generate)
        if greedy and not (generate and params.get("is_normalized")):
            # SGLang forces top_k = 1 for greedy items whatever top_k says, unless the
            # sampling_params carry a truthy `is_normalized`, which skips that step.
            if mask_on:
                items.append(MaskItem(1, _below_one(params.get("top_p"))))
            return None
        if "top_k" in params:
            raw = params["top_k"]
            k = plain_int(raw, "top_k") if generate else lax_int(raw, "top_k")
            if k is None and not generate:
                k = self.mask.default_top_k  # OpenAI routes: null falls back like omitted
        else:
            k = self.mask.default_top_k
        if k is not None:
            bad = _top_k_range(k)
            if bad is not None:
                return bad
        if mask_on:
            normal = TOP_K_ALL if k is None or k == -1 else k
            raw = params.get("top_k")
            shown = raw if generate and isinstance(raw, float) and normal == raw else None
            items.append(MaskItem(normal, _below_one(params.get("top_p")), shown))
        return None


def _below_one(top_p: object) -> bool:
    # Only a real number counts: a string top_p (lax on OpenAI routes) is taken as 1, which
    # can only make the gateway stricter, for the one release (0.5.18) that reads it.
    return isinstance(top_p, int | float) and not isinstance(top_p, bool) and top_p < 1


def _sample_count(value: object, *, generate: bool) -> float | None:
    """`n` as SGLang would use it, where it is a number; other spellings are left to the
    backend's own validation (a string n on /generate crashes SGLang before it allocates)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return value
    if not generate and isinstance(value, str):
        try:
            return lax_int(value, "n")  # pydantic reads "5000" as 5000 on OpenAI routes
        except Invalid:
            return None
    return None


def _parallel(params: object) -> bool:
    if not isinstance(params, dict):
        return False
    n = params.get("n")
    return isinstance(n, int | float) and not isinstance(n, bool) and n > 1


def _truthy(value: object, field: str) -> bool:
    """How SGLang's scheduler reads a flag that pydantic never validated."""
    return bool(value)


def _batch_size(body: Mapping[str, Any], *, raw: bool = False) -> int | None:
    """Items in a /generate batch, or None for a single request (docs/sglang-contract.md s.4).

    Like SGLang's `_determine_batch_size`, the first of text, input_ids, input_embeds that is
    not null decides alone: a batch-shaped input_embeds next to a string text is a single
    request, on which a list mask such as [false] is truthy. raw: no pydantic coercion ran
    (/vertex_generate), so SGLang's `isinstance(input_embeds[0][0], float)` is taken literally.
    """
    text = body.get("text")
    if text is not None:
        return len(text) if isinstance(text, list) else None
    # input_ids and input_embeds may be Heads (gateway/contract/shapes.py): read through
    # length_of and first_of only.
    value = body.get("input_ids")
    if value is not None:
        size = length_of(value)
        return size if size > 0 and length_of(first_of(value)) >= 0 else None
    embeds = body.get("input_embeds")
    size = length_of(embeds)
    if size > 0:
        first = first_of(embeds)
        if length_of(first) > 0:
            inner = first_of(first)
            if raw and not isinstance(inner, float):
                return size
            if length_of(inner) >= 0:
                return size
    return None  # one sequence of embedding vectors is a single request
