"""Scoring: compute each requested reward component of each sample and their weighted sum.

Components are built-in verifiers (rlmesh.reward.verifiers), per-sample custom
functions and group functions, the latter two loaded by import path from the
operator's settings, and remote reward services registered by URL
(rlmesh.reward.registry): a registered name "my_judge" is a component, and so is
each named score it returns, "my_judge/style". Bad requests (unknown component names,
bad weights) raise errors.InvalidArgument before anything is scored. A component that fails on a sample
(raises, returns something that is not a finite number) marks that sample FAILED with
the reason in metadata["reward_error"] (and the failed components' names in
metadata["reward_failed_components"]): it is excluded from training and counted,
never a silent 0. Every component value computed is kept in sample.reward_components
beside the weighted total in sample.reward.

Built-in verifiers read the last max_answer_chars characters of a response and of a label
(the final answer is at the end). Given a VerifierPool (the service always has one) they run
in its worker processes, each call within the pool's time budget: a sample past it fails with
"verifier timeout" while the others go on. Without one they run in a thread, unbounded.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from rlmesh.common import errors
from rlmesh.common.limits import MAX_ABS_REWARD, MAX_REWARD_WEIGHT
from rlmesh.common.plugins import load_plugin
from rlmesh.common.sample import Sample, SampleGroup, Status
from rlmesh.reward.registry import RemoteRegistry
from rlmesh.reward.remote import Unit
from rlmesh.reward.resilience import RemoteCaller
from rlmesh.reward.verifiers import DEFAULT_MAX_ANSWER_CHARS
from rlmesh.reward.workers import BUILTIN_VERIFIERS, VerifierError, VerifierPool

log = logging.getLogger(__name__)

Kind = Literal["builtin", "sample", "group"]


@dataclass(frozen=True)
class RewardSpec:
    """Component name -> weight (empty = the service's defaults), and which entry of a
    dict-valued reward to use."""

    components: dict[str, float] = field(default_factory=dict)
    reward_key: str = ""


@dataclass(frozen=True)
class Component:
    name: str
    kind: Kind
    fn: Callable[..., Any]

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None))  # noqa: B004 - async __call__ of an object


# Why a component gave no score, in a word (the metrics count failed samples by these):
RAISED = "raised"  # the function raised
INVALID_VALUE = "invalid_value"  # it returned something that is not a finite reward (or the wrong count)
FAILURE_CAUSES = (
    RAISED,
    INVALID_VALUE,
    "timeout",
    "worker_died",
    "stopping",  # (built-in verifiers' too)
    "remote_failed",
    "missing_score",
)  # a remote service's call failed; or lacked the named score


class _ComponentFailed(Exception):
    """A component could not score a sample; the message goes into metadata["reward_error"]."""


def _as_reward(value: Any, reward_key: str, name: str) -> float:
    """A component's result as a finite float; a dict result is reduced with reward_key."""
    if isinstance(value, dict):
        if not reward_key:
            raise _ComponentFailed(
                f"{name} returned a dict (keys: {', '.join(map(str, value))}); set reward_key in the spec to pick one"
            )
        if reward_key not in value:
            raise _ComponentFailed(
                f"{name} returned a dict without reward_key '{reward_key}' (keys: {', '.join(map(str, value))})"
            )
        value = value[reward_key]
    if not isinstance(value, numbers.Real):
        raise _ComponentFailed(f"{name} returned {type(value).__name__}, not a number")
    result = float(value)
    if not abs(result) <= MAX_ABS_REWARD:  # (NaN and infinities too)
        raise _ComponentFailed(f"{name} returned {result}, outside ±{MAX_ABS_REWARD:g} (scale the reward down)")
    return result


def _describe(name: str, e: BaseException) -> str:
    return f"{name} raised {type(e).__name__}: {e}"


@dataclass
class _Outcome:
    """What scoring found for one sample, before it is written back."""

    values: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # names of the components that failed
    causes: list[str] = field(default_factory=list)  # kinds of the failures (FAILURE_CAUSES)

    def fail(self, name: str, reason: str, cause: str = "raised") -> None:
        self.errors.append(reason)
        if name not in self.failed:
            self.failed.append(name)
        if cause not in self.causes:
            self.causes.append(cause)


@dataclass
class ScorerStats:
    samples_scored: int = 0
    samples_failed: int = 0
    failures_by_component: dict[str, int] = field(default_factory=dict)
    # Failed samples by the kind of failure (one of FAILURE_CAUSES; a sample counts once per kind).
    failures_by_cause: dict[str, int] = field(default_factory=dict)


# A sample with its component weights, and the group it came from (None: scored alone).
_Plan = tuple[Sample, dict[str, float]]
_Batch = tuple[SampleGroup | None, list[_Plan]]


class Scorer:
    def __init__(
        self,
        components: dict[str, Component],
        default_components: dict[str, float],
        remotes: RemoteRegistry | None = None,
        verifier_pool: VerifierPool | None = None,
        max_answer_chars: int = DEFAULT_MAX_ANSWER_CHARS,
    ) -> None:
        self.components = components
        self.default_components = dict(default_components)
        self.remotes = remotes
        self.verifier_pool = verifier_pool
        self.max_answer_chars = max_answer_chars
        self.stats = ScorerStats()
        self._check_weights(self.default_components, "default_components", callers={})

    @classmethod
    def from_config(
        cls,
        default_components: dict[str, float],
        custom_functions: dict[str, str] | None = None,
        group_functions: dict[str, str] | None = None,
        remotes: RemoteRegistry | None = None,
        verifier_pool: VerifierPool | None = None,
        max_answer_chars: int = DEFAULT_MAX_ANSWER_CHARS,
    ) -> Scorer:
        """Built-ins (the pool's, when there is one) plus the operator's functions, imported now
        so a bad path fails at startup."""
        builtins = verifier_pool.verifiers if verifier_pool is not None else BUILTIN_VERIFIERS
        components = {name: Component(name, "builtin", load_plugin(path)) for name, path in builtins.items()}
        for kind, functions in (("sample", custom_functions or {}), ("group", group_functions or {})):
            for name, path in functions.items():
                if name in components:
                    raise ValueError(f"reward component '{name}' is defined twice")
                components[name] = Component(name, kind, load_plugin(path))
        return cls(components, default_components, remotes, verifier_pool, max_answer_chars)

    def known_components(self, callers: dict[str, RemoteCaller] | None = None) -> list[str]:
        return sorted([*self.components, *(callers or {})])

    # ------------------------------------------------------------ request checks

    @staticmethod
    def _remote_of(name: str, callers: dict[str, RemoteCaller]) -> str | None:
        """'my_judge' or 'my_judge/style' -> 'my_judge' when that service is registered."""
        service = name.split("/", 1)[0]
        return service if service in callers else None

    def _check_weights(
        self, weights: dict[str, float], where: str, callers: dict[str, RemoteCaller], allow_group: bool = True
    ) -> None:
        for name, weight in weights.items():
            component = self.components.get(name)
            if component is None and self._remote_of(name, callers) is None:
                raise errors.InvalidArgument(
                    f"{where}: unknown reward component '{name}'; known components: "
                    f"{', '.join(self.known_components(callers))} (a remote reward service is registered with POST /reward-services)"
                )
            if component is not None and component.kind == "group" and not allow_group:
                raise errors.InvalidArgument(
                    f"{where}: reward component '{name}' scores whole groups; call ScoreGroups with the groups instead"
                )
            if not isinstance(weight, numbers.Real) or isinstance(weight, bool) or not abs(weight) <= MAX_REWARD_WEIGHT:
                raise errors.InvalidArgument(
                    f"{where}: the weight of '{name}' must be a number within ±{MAX_REWARD_WEIGHT:g}, got {weight!r}"
                )

    def _base_weights(self, spec: RewardSpec, allow_group: bool, callers: dict[str, RemoteCaller]) -> dict[str, float]:
        """The spec's components; when it names none, the defaults plus every registered
        service with a non-zero weight."""
        weights = dict(spec.components)
        if not weights:
            weights = dict(self.default_components)
            weights.update({n: c.config.weight for n, c in callers.items() if c.config.weight})
        if not weights:  # scoring with nothing would be a silent 0
            raise errors.InvalidArgument(
                "no reward components: the request names none, and the reward service has no default_components "
                "and no registered service with a weight"
            )
        self._check_weights(weights, "spec", callers, allow_group)
        return weights

    async def check_spec(self, spec: RewardSpec) -> list[tuple[str, str]]:
        """What scoring groups with `spec` would refuse, as (field, message): each unknown
        component (or bad weight) as "components.<name>", no components at all as "components"."""
        callers = await self._callers()
        if not spec.components:
            try:
                self._base_weights(spec, True, callers)
            except errors.InvalidArgument as e:
                return [("components", str(e))]
            return []
        problems = []
        for name, weight in spec.components.items():
            try:
                self._check_weights({name: weight}, "reward.components", callers)
            except errors.InvalidArgument as e:
                problems.append((f"components.{name}", str(e)))
        return problems

    def _sample_weights(
        self, sample: Sample, base: dict[str, float], allow_group: bool, callers: dict[str, RemoteCaller]
    ) -> dict[str, float]:
        """metadata["reward"] (a component name, or name -> weight) overrides the spec for one sample."""
        override = sample.metadata.get("reward")
        if override is None:
            return base
        where = f"sample {sample.index}: metadata['reward']"
        if isinstance(override, str):
            weights = {override: 1.0}
        elif isinstance(override, dict) and override:
            weights = dict(override)
        else:
            raise errors.InvalidArgument(
                f"{where} must be a component name or a non-empty object of name -> weight, got {override!r}"
            )
        self._check_weights(weights, where, callers, allow_group)
        return weights

    async def _callers(self) -> dict[str, RemoteCaller]:
        return await self.remotes.callers() if self.remotes is not None else {}

    # ------------------------------------------------------------ scoring

    async def score_samples(self, samples: list[Sample], spec: RewardSpec) -> list[Sample]:
        """Score samples one by one (no group functions); returns the same, updated, objects."""
        callers = await self._callers()
        base = self._base_weights(spec, False, callers)
        plans = [(s, self._sample_weights(s, base, False, callers)) for s in samples]
        await self._score([(None, plans)], spec.reward_key, callers)
        return samples

    async def score_groups(self, groups: list[SampleGroup], spec: RewardSpec) -> list[SampleGroup]:
        """Score whole groups; a group function sees the group's samples that ask for it,
        and a remote service gets them in one request."""
        callers = await self._callers()
        base = self._base_weights(spec, True, callers)
        batches = [(g, [(s, self._sample_weights(s, base, True, callers)) for s in g.samples]) for g in groups]
        await self._score(batches, spec.reward_key, callers)
        return groups

    async def _score(self, batches: list[_Batch], reward_key: str, callers: dict[str, RemoteCaller]) -> None:
        # Samples that already failed (generation errors) keep their status and are not scored.
        batches = [(g, [(s, w) for s, w in plans if s.status != Status.FAILED]) for g, plans in batches]
        outcomes = {id(s): _Outcome() for _, plans in batches for s, _ in plans}
        sync_jobs: list[Callable[[], None]] = []
        async_jobs: list[Any] = []
        verifier_calls: list[tuple[str, Sample, _Outcome]] = []

        def add(component: Component, job: Callable[[], Any]) -> None:
            if component.is_async:
                async_jobs.append(job())
            else:
                sync_jobs.append(job)

        for _, plans in batches:
            for sample, weights in plans:
                for name in weights:
                    component = self.components.get(name)
                    if component is None or component.kind == "group":
                        continue
                    if component.kind == "builtin" and self.verifier_pool is not None:
                        verifier_calls.append((name, sample, outcomes[id(sample)]))
                    else:
                        add(component, self._sample_job(component, sample, outcomes[id(sample)], reward_key))
            group_names = sorted(
                {n for _, w in plans for n in w if n in self.components and self.components[n].kind == "group"}
            )
            for name in group_names:
                component = self.components[name]
                members = [s for s, w in plans if name in w]
                member_outcomes = [outcomes[id(s)] for s in members]
                add(component, self._group_job(component, members, member_outcomes, reward_key))

        if verifier_calls:
            async_jobs.append(self._verifier_job(verifier_calls, reward_key))
        for service, caller in callers.items():
            needed = self._remote_plans(batches, service, callers)
            if needed:
                async_jobs.append(self._remote_job(caller, needed, outcomes, reward_key))

        # Sync custom functions (and built-in verifiers when there is no pool) are CPU work:
        # they run in one worker thread per request, so the event loop stays free for health
        # checks, other calls, the verifier pool, the async functions and the remote services.
        if sync_jobs:
            async_jobs.append(asyncio.to_thread(lambda: [job() for job in sync_jobs]))
        await asyncio.gather(*async_jobs)

        for _, plans in batches:
            for sample, weights in plans:
                self._write_back(sample, weights, outcomes[id(sample)])

    def _remote_plans(
        self, batches: list[_Batch], service: str, callers: dict[str, RemoteCaller]
    ) -> list[tuple[Unit, list[list[str]]]]:
        """The samples that ask for `service` (or one of its named scores), as units that
        keep groups whole, with the component names each sample asks for."""
        needed: list[tuple[Unit, list[list[str]]]] = []
        for group, plans in batches:
            asking = [
                (s, [n for n in w if n not in self.components and self._remote_of(n, callers) == service])
                for s, w in plans
            ]
            asking = [(s, names) for s, names in asking if names]
            if not asking:
                continue
            if group is None:  # scored one by one: each sample is its own unit
                needed.extend((Unit([s]), [names]) for s, names in asking)
            else:
                needed.append((Unit([s for s, _ in asking], group), [names for _, names in asking]))
        return needed

    @staticmethod
    async def _remote_job(
        caller: RemoteCaller,
        needed: list[tuple[Unit, list[list[str]]]],
        outcomes: dict[int, _Outcome],
        reward_key: str,
    ) -> None:
        service = caller.config.name
        results = await caller.score([unit for unit, _ in needed])
        asked = [(s, names) for unit, names_per_sample in needed for s, names in zip(unit.samples, names_per_sample)]
        for (sample, names), result in zip(asked, results):
            outcome = outcomes[id(sample)]
            if isinstance(result, str):
                for name in names:
                    outcome.fail(name, result, "remote_failed")
                continue
            # Every named score is kept on the sample, asked for or not: it explains the total.
            for key, value in result.named.items():
                outcome.values[f"{service}/{key}"] = value
            for name in names:
                _, _, key = name.partition("/")
                if key:
                    if key not in result.named:
                        outcome.fail(
                            name,
                            f"{service} returned no score named '{key}' "
                            f"(it returned: {', '.join(result.named) or 'a single score'})",
                            "missing_score",
                        )
                elif result.total is not None:
                    outcome.values[name] = result.total
                elif reward_key and reward_key in result.named:
                    outcome.values[name] = result.named[reward_key]
                else:
                    outcome.fail(
                        name,
                        f"{service} returned named scores ({', '.join(result.named)}); name one in the "
                        f"spec as '{service}/<name>' or set reward_key",
                        "missing_score",
                    )

    def _verifier_texts(self, sample: Sample) -> tuple[str, str]:
        """What a built-in verifier reads: the tails of the response and the label."""
        return sample.response[-self.max_answer_chars :], sample.label[-self.max_answer_chars :]

    async def _verifier_job(self, calls: list[tuple[str, Sample, _Outcome]], reward_key: str) -> None:
        """Every built-in verifier call of a request, through the pool at once."""
        assert self.verifier_pool is not None
        results = await self.verifier_pool.verify_many(
            [(name, *self._verifier_texts(sample), sample.metadata) for name, sample, _ in calls]
        )
        for (name, _, outcome), result in zip(calls, results):
            if isinstance(result, VerifierError):
                outcome.fail(name, str(result), result.cause)
                continue
            try:
                outcome.values[name] = _as_reward(result, reward_key, name)
            except _ComponentFailed as e:
                outcome.fail(name, str(e), INVALID_VALUE)

    def _sample_job(
        self, component: Component, sample: Sample, outcome: _Outcome, reward_key: str
    ) -> Callable[[], Any]:
        def record(result: Any) -> None:
            outcome.values[component.name] = _as_reward(result, reward_key, component.name)

        if component.is_async:

            async def run_async() -> None:
                try:
                    record(await component.fn(sample))
                except _ComponentFailed as e:
                    outcome.fail(component.name, str(e), INVALID_VALUE)
                except Exception as e:
                    log.warning("reward component %s failed on sample %d", component.name, sample.index, exc_info=True)
                    outcome.fail(component.name, _describe(component.name, e), RAISED)

            return run_async

        def run_sync() -> None:
            try:
                if component.kind == "builtin":
                    record(component.fn(*self._verifier_texts(sample), sample.metadata))
                else:
                    record(component.fn(sample))
            except _ComponentFailed as e:
                outcome.fail(component.name, str(e), INVALID_VALUE)
            except Exception as e:
                if component.kind != "builtin":
                    log.warning("reward component %s failed on sample %d", component.name, sample.index, exc_info=True)
                outcome.fail(component.name, _describe(component.name, e), RAISED)

        return run_sync

    @staticmethod
    def _group_job(
        component: Component, members: list[Sample], outcomes: list[_Outcome], reward_key: str
    ) -> Callable[[], Any]:
        def record(results: Any) -> None:
            if not isinstance(results, Sequence) or isinstance(results, (str, bytes)):
                raise _ComponentFailed(f"{component.name} returned {type(results).__name__}, not a list of rewards")
            if len(results) != len(members):
                raise _ComponentFailed(
                    f"{component.name} returned {len(results)} rewards for a group of {len(members)} samples"
                )
            values = [_as_reward(r, reward_key, component.name) for r in results]
            for outcome, value in zip(outcomes, values):
                outcome.values[component.name] = value

        def fail(reason: str, cause: str) -> None:
            for outcome in outcomes:
                outcome.fail(component.name, reason, cause)

        if component.is_async:

            async def run_async() -> None:
                try:
                    record(await component.fn(members))
                except _ComponentFailed as e:
                    fail(str(e), INVALID_VALUE)
                except Exception as e:
                    log.warning("group reward component %s failed", component.name, exc_info=True)
                    fail(_describe(component.name, e), RAISED)

            return run_async

        def run_sync() -> None:
            try:
                record(component.fn(members))
            except _ComponentFailed as e:
                fail(str(e), INVALID_VALUE)
            except Exception as e:
                log.warning("group reward component %s failed", component.name, exc_info=True)
                fail(_describe(component.name, e), RAISED)

        return run_sync

    def _write_back(self, sample: Sample, weights: dict[str, float], outcome: _Outcome) -> None:
        sample.reward_components = dict(outcome.values)
        total = sum(weight * outcome.values.get(name, 0.0) for name, weight in weights.items())
        if not outcome.errors and not abs(total) <= MAX_ABS_REWARD:
            outcome.errors.append(
                f"the weighted total {total:g} is outside ±{MAX_ABS_REWARD:g} (scale the weights down)"
            )
            outcome.causes.append(INVALID_VALUE)
        if outcome.errors:
            sample.status = Status.FAILED
            sample.reward = 0.0
            sample.metadata["reward_error"] = "; ".join(outcome.errors)
            sample.metadata["reward_failed_components"] = list(outcome.failed)
            self.stats.samples_failed += 1
            for name in outcome.failed:
                self.stats.failures_by_component[name] = self.stats.failures_by_component.get(name, 0) + 1
            for cause in outcome.causes:
                self.stats.failures_by_cause[cause] = self.stats.failures_by_cause.get(cause, 0) + 1
            return
        sample.reward = total
        self.stats.samples_scored += 1
