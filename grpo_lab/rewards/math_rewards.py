"""Correctness of a math answer, checked with math-verify (an optional extra:
``pip install 'grpo_lab[math]'``): the gold ``solution`` and the completion are parsed to
symbolic expressions and compared, so that ``\\frac{1}{2}``, ``0.5`` and ``1/2`` agree.

math-verify bounds its parsing and comparison with ``signal.alarm``, which only works in the main
thread; called from any other thread (a worker pool, a notebook's background thread) these
functions run it without its timeouts, as TRL does, instead of failing."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from grpo_lab.rewards.extraction import completion_text

__all__ = ["accuracy_reward", "reasoning_accuracy_reward"]

INSTALL_HINT = "pip install 'grpo_lab[math]'"
_PARSE_TIMEOUT, _VERIFY_TIMEOUT = 10, 5  # seconds, in the main thread (TRL's values)


def _math_verify():
    """The math_verify module, or an ImportError that says how to install it."""
    try:
        import math_verify
    except ImportError as error:
        raise ImportError(
            f"The math reward functions need math-verify, an optional extra of grpo_lab: {INSTALL_HINT} "
            "(or pip install 'math-verify[antlr4_13_2]')."
        ) from error
    return math_verify


class _NoTimeoutNotice(logging.Filter):
    """Drops math-verify's warning that its timeouts are off, which these functions turn off on
    purpose outside the main thread (the module docstring says so)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_FILTER = _NoTimeoutNotice()


def _quiet_timeout_notice() -> None:
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def _safely(call, fallback):
    """``call()``, or ``fallback`` if math-verify raises anyway (its TimeoutException is a BaseException)."""
    try:
        return call()
    except Exception:
        return fallback
    except BaseException as error:
        if type(error).__name__ != "TimeoutException":
            raise
        return fallback


class _Checker:
    """One batch's checks: parses and compares with the timeouts the current thread allows, and
    keeps what the logs show."""

    def __init__(self):
        self.mv = _math_verify()
        main = threading.current_thread() is threading.main_thread()
        self.parse_timeout = _PARSE_TIMEOUT if main else None
        self.verify_timeout = _VERIFY_TIMEOUT if main else None
        if not main:
            _quiet_timeout_notice()
        self.answer_config = [self.mv.LatexExtractionConfig(
            normalization_config=self.mv.LatexNormalizationConfig(units=True),
            boxed_match_priority=0,  # a \boxed answer is tried first
            try_extract_without_anchor=False,  # no number picked out of the middle of the reasoning
        )]
        self.gold_shown, self.answer_shown = [], []
        self.unparseable_solutions = self.unparseable_answers = 0

    def score(self, answer_text: str, solution: str) -> float | None:
        gold = _safely(lambda: self.mv.parse(solution, parsing_timeout=self.parse_timeout), [])
        if not gold:
            self.unparseable_solutions += 1
            self.gold_shown.append("[unparseable]")
            self.answer_shown.append("[skipped]")
            return None
        answer = _safely(lambda: self.mv.parse(answer_text, extraction_config=self.answer_config,
                                               extraction_mode="first_match", parsing_timeout=self.parse_timeout), [])
        self.unparseable_answers += not answer
        self.gold_shown.append(_safely(lambda: str(gold), "[unprintable]"))
        self.answer_shown.append(_safely(lambda: str(answer), "[unprintable]") if answer else "[unparseable]")
        if not answer:
            return 0.0
        return float(_safely(lambda: self.mv.verify(gold, answer, timeout_seconds=self.verify_timeout), False))

    def skip(self, why: str) -> float:
        self.gold_shown.append(why)
        self.answer_shown.append(why)
        return 0.0

    def report(self, solution: list, log_extra, log_metric) -> None:
        if log_extra is not None:
            log_extra("solution", list(solution))
            log_extra("gold_parsed", self.gold_shown)
            log_extra("answer_parsed", self.answer_shown)
        if log_metric is not None:
            log_metric("math_verify/parse_failures", self.unparseable_solutions + self.unparseable_answers)
            log_metric("math_verify/unparseable_solutions", self.unparseable_solutions)


def accuracy_reward(completions: list, solution: list[str], log_extra: Callable[[str, list], None] | None = None,
                    log_metric: Callable[[str, float], None] | None = None, **kwargs) -> list[float | None]:
    """1.0 when the completion's answer equals the gold ``solution`` mathematically, else 0.0;
    None where the solution itself cannot be parsed (the sample is skipped).

    Formula: r = 1 if verify(parse(solution), parse(answer)) else 0, where the answer is the first
    LaTeX answer of the completion, a ``\\boxed{}`` one first, and only one math-verify finds anchored
    (TRL's extraction settings), so a bare ``$27$`` or a number in the middle of the reasoning does
    not count, as in TRL.
    An answer math-verify cannot find or parse scores 0. Both are counted, per call, in the metrics
    ``math_verify/parse_failures`` (solutions plus answers) and ``math_verify/unparseable_solutions``
    when ``log_metric`` is passed (it is, by a trainer); ``log_extra`` receives the columns
    ``solution``, ``gold_parsed`` and ``answer_parsed``. Never raises for odd text.

    The completion's text is ``extraction.completion_text``: a plain string, or the content of the
    last assistant message of a conversational completion.

    Source: TRL 1.16 ``trl.rewards.accuracy_reward``: the same values and logged columns where TRL
    reads the same text, which is always the case for a completion of one message. TRL reads the
    first message (``completion[0]["content"]``), so they differ for a completion of several
    messages whose last assistant message is not the first (a tool call, its result, then the
    answer: TRL scores the tool call's text, this function the answer). Unlike TRL's, it also takes
    plain-text completions. Requires the ``math`` extra: ``pip install 'grpo_lab[math]'``.
    """
    checker = _Checker()
    rewards = [checker.score(completion_text(c), sol) for c, sol in zip(completions, solution, strict=True)]
    checker.report(solution, log_extra, log_metric)
    return rewards


def reasoning_accuracy_reward(completions: list, solution: list[str], reasoning_delimiters: list[str] | None = None,
                              log_extra: Callable[[str, list], None] | None = None,
                              log_metric: Callable[[str, float], None] | None = None,
                              **kwargs) -> list[float | None]:
    """``accuracy_reward`` on the final answer only: the text after the reasoning block.

    Formula: with d the first of ``reasoning_delimiters`` (default ``["</think>"]``) that occurs
    in the completion, the answer text is what follows the last occurrence of d, and
    r = accuracy_reward(answer text). A completion with none of the delimiters did not finish
    reasoning and gets 0.0 (not None: unfinished reasoning is penalised), whatever its solution;
    an unparseable solution otherwise gives None. Logs as ``accuracy_reward``.

    Source: TRL 1.16 ``trl.rewards.reasoning_accuracy_reward``: the same values and logged columns
    for a completion of one message; for one of several messages it reads the last assistant
    message where TRL reads the first (``completion[0]["content"]``), as ``accuracy_reward`` does.
    Unlike TRL's, it also takes plain-text completions. Requires the ``math`` extra:
    ``pip install 'grpo_lab[math]'``.
    """
    delimiters = ["</think>"] if reasoning_delimiters is None else reasoning_delimiters
    checker = _Checker()
    rewards = []
    for completion, sol in zip(completions, solution, strict=True):
        text = completion_text(completion)
        delimiter = next((d for d in delimiters if d in text), None)
        if delimiter is None:
            rewards.append(checker.skip("[incomplete reasoning]"))
        else:
            rewards.append(checker.score(text.split(delimiter)[-1], sol))
    checker.report(solution, log_extra, log_metric)
    return rewards
