"""The judge of ``code_sandbox``: runs the tests in a process of its own and decides which passed.
Standard library only; grpo_lab never imports it: the sandbox's child program runs it, in the
process that is not the solution's, after the two have been split (see ``code_sandbox_child``).

The solution's process runs the solution and then only answers requests; the tests run here,
where the solution's code never runs. Every name the solution defined is here as a stand-in:
a plain value (None, bool, int, float, complex, str, bytes, bytearray, and tuples, lists, dicts,
sets and frozensets of them) as a copy, anything else (a function, a class, an instance, a
module) as a ``Remote`` whose attribute reads and writes, calls, items, length, iteration,
truth, ``repr`` and ``str`` are requests to the solution's process (``x in`` one iterates over
it and compares the plain values here). What comes back is a plain
value, rebuilt here from JSON, or another ``Remote``; an exception the solution raised comes back
as the built-in exception of that name (``RemoteError`` for its own classes) with its message.
So nothing the solution does decides a comparison, an ``isinstance`` or an ``assert``: a value
whose ``__eq__`` is always true arrives as a ``Remote``, which refuses to be compared; a
redefined built-in stays in the solution's process; the verdict and the nonce of the result line
never reach it.

What the tests can pass to the solution: plain values and ``Remote`` objects (e.g. an instance
of the solution's class); a list, dict, set or bytearray passed positionally that a call changed in
place is changed here too. Not a function or an object of the tests' own (e.g. a lambda as an
argument): such a call raises TypeError, and the test fails. A name the solution defines that is a
built-in's (``sorted``, ``all``) is not given to the tests: theirs stay Python's."""

import builtins
import json
import os
import sys
import types

BUILT_IN_NAMES = frozenset(vars(builtins))
"""Names the solution may define but the tests never see as its: a built-in it shadows stays the built-in."""
MUTABLE = (list, dict, set, bytearray)


class SolutionEnded(BaseException):
    """The solution's process ended (or broke the protocol) while the tests needed it: there is
    no verdict to give. A BaseException, and remembered by the channel, so that a test's own
    ``except Exception`` cannot turn the end into a pass."""


class RemoteError(Exception):
    """An exception of a class the solution defined (or one that is not built in)."""


class Channel:
    """Requests to the solution's process and its replies: one JSON document per line each way."""

    def __init__(self, requests_fd: int, replies_fd: int, to_wire, from_wire):
        self._requests = os.fdopen(requests_fd, "w", encoding="utf-8", newline="\n")
        self._replies = os.fdopen(replies_fd, "r", encoding="utf-8", newline="\n")
        self._to_wire, self._from_wire = to_wire, from_wire
        self._remotes = {}
        self.ended = False

    def remote(self, handle: int) -> "Remote":
        """The one ``Remote`` of each of the solution's objects (so that ``is`` holds across calls)."""
        if handle not in self._remotes:
            self._remotes[handle] = Remote(self, handle)
        return self._remotes[handle]

    def encode(self, value):
        """A value of the tests on the wire: plain values, and the solution's own objects by handle."""
        return self._to_wire(value, self._handle_of)

    @staticmethod
    def _handle_of(value) -> int:
        if type(value) is Remote:
            return object.__getattribute__(value, "_Remote__handle")
        raise TypeError(f"the tests can pass the solution plain values and objects it returned, not a "
                        f"{type(value).__name__}: the solution runs in a process of its own")

    def decode(self, data):
        return self._from_wire(data, self.remote)

    def receive(self):
        """The next reply of the solution's process, rebuilt from JSON (nothing of the solution runs)."""
        line = self._replies.readline()
        if not line.endswith("\n"):
            self._end("the solution's process ended")
        try:
            return json.loads(line)
        except (ValueError, RecursionError) as error:
            self._end(f"the solution's process sent something that is not a reply: {error}")

    def _end(self, why: str):
        self.ended = True
        raise SolutionEnded(why)

    def ask(self, operation: str, handle: int | None, *operands, mutable=()):
        """Send one request and return its value, or raise what the solution raised; write back into
        ``mutable`` (the call's arguments) the state the solution left them in."""
        try:
            self._requests.write(f"{_dumps([operation, handle, *operands])}\n")
            self._requests.flush()
        except OSError:
            self._end("the solution's process ended")
        reply = self.receive()
        if not isinstance(reply, dict):
            self._end("the solution's process sent something that is not a reply")
        if "raised" in reply:
            raise _exception(reply["raised"], ends_iteration=operation == "next")
        for argument, state in zip(mutable, reply.get("arguments", ()), strict=False):
            if state is not None and isinstance(argument, MUTABLE):
                _write_back(argument, self.decode(state))
        return self.decode(reply.get("value"))


def _dumps(document) -> str:
    return json.dumps(document, separators=(",", ":"))


# What ends a loop or a generator here: only a ``next`` request may raise it, as the end of an iteration.
# From any other request it would end the tests' own loop early (``all(map(check, cases))`` true after
# none of them), which is deciding a test, not answering it.
ENDS_ITERATION = ("StopIteration", "StopAsyncIteration")


def _exception(raised, ends_iteration: bool = False) -> BaseException:
    """The exception to raise here for what the solution raised: the built-in class of that name
    (a name only, looked up in builtins: no class of the solution's), else ``RemoteError``;
    ``StopIteration`` only where ``ends_iteration`` (the answer to ``next``)."""
    name, message = (raised + ["", ""])[:2] if isinstance(raised, list) else ("", "")
    name, message = str(name), str(message)
    if name in ENDS_ITERATION and not ends_iteration:
        return RemoteError(f"{name}: {message}")
    kind = getattr(builtins, name, None) if name.isidentifier() else None
    if isinstance(kind, type) and issubclass(kind, BaseException):
        try:
            return kind(message)
        except Exception:  # a built-in exception whose constructor needs more (UnicodeDecodeError)
            pass
    return RemoteError(f"{name}: {message}")


def _write_back(argument, state) -> None:
    """Change ``argument`` in place to ``state``, as the solution's call changed its copy."""
    if isinstance(argument, (list, bytearray)) and isinstance(state, (list, bytearray)):
        argument[:] = state
    elif isinstance(argument, (dict, set)) and type(state) is type(argument):
        argument.clear()
        argument.update(state)


def _refuse_comparison(self, other):
    if other is self:
        return True
    raise TypeError("an object the solution returned is compared by the solution's own code, which could make any "
                    "comparison true: compare its plain values (its attributes, list(...), str(...)) instead")


class Remote:
    """One of the solution's objects, seen from the tests: each use is a request to its process."""

    # Name-mangled (``_Remote__...``), so that they do not hide attributes of the solution's objects.
    __slots__ = ("__channel", "__handle")

    def __init__(self, channel: Channel, handle: int):
        object.__setattr__(self, "_Remote__channel", channel)
        object.__setattr__(self, "_Remote__handle", handle)

    def __ask(self, operation: str, *operands, mutable=()):
        channel = object.__getattribute__(self, "_Remote__channel")
        return channel.ask(operation, object.__getattribute__(self, "_Remote__handle"), *operands, mutable=mutable)

    def __encode(self, value):
        return object.__getattribute__(self, "_Remote__channel").encode(value)

    def __getattr__(self, name):
        # Python and libraries look special names up to decide how to treat an object (numpy's
        # __array_interface__ would read memory at an address the answer names): not the solution's to answer.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return self.__ask("getattr", name)

    def __setattr__(self, name, value):
        self.__ask("setattr", name, self.__encode(value))

    def __delattr__(self, name):
        self.__ask("delattr", name)

    def __call__(self, *args, **kwargs):
        encoded = [self.__encode(a) for a in args], {str(k): self.__encode(v) for k, v in kwargs.items()}
        return self.__ask("call", *encoded, mutable=args)

    def __getitem__(self, key):
        return self.__ask("getitem", self.__encode(key))

    def __setitem__(self, key, value):
        self.__ask("setitem", self.__encode(key), self.__encode(value))

    def __delitem__(self, key):
        self.__ask("delitem", self.__encode(key))

    def __len__(self):
        return _checked(self.__ask("len"), int)

    def __bool__(self):
        return _checked(self.__ask("bool"), bool)

    def __iter__(self):
        return self.__ask("iter")

    def __next__(self):
        return self.__ask("next")

    def __repr__(self):
        return _checked(self.__ask("repr"), str)

    def __str__(self):
        return _checked(self.__ask("str"), str)

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse_comparison
    __hash__ = object.__hash__


def _checked(value, kind):
    if type(value) is not kind:
        raise TypeError(f"the solution answered a {type(value).__name__} where Python needs a {kind.__name__}")
    return value


def judge(statements: list, requests_fd: int, replies_fd: int, to_wire, from_wire) -> list | None:
    """Run each statement of the tests (``[source, is_test]`` pairs) against the solution's names;
    True/False per test; None when the solution's process ended before the tests did (as a
    solution that ends its own process has no verdict). ``to_wire``/``from_wire``: the wire
    format of the child program, shared with the solution's side."""
    channel = Channel(requests_fd, replies_fd, to_wire, from_wire)
    try:
        first = channel.receive()
        names = first.get("names") if isinstance(first, dict) else None
        if not isinstance(names, dict):
            return None
        module = types.ModuleType("solution")  # tests may also `from solution import f`
        for name, value in names.items():
            if str(name) not in BUILT_IN_NAMES:  # the tests' own sorted, all, abs... whatever the solution named
                setattr(module, str(name), channel.decode(value))
    except (SolutionEnded, Exception):  # ended, or a value that cannot be rebuilt here (a set of lists)
        return None
    sys.modules["solution"] = module
    namespace = module.__dict__
    passed = []
    for index, (source, is_test) in enumerate(statements):
        try:
            exec(compile(source, f"<test {index}>", "exec"), namespace)
            ok = True
        except BaseException:  # SystemExit and KeyboardInterrupt fail the test too
            ok = False
        if channel.ended:  # whatever the test caught
            return None
        if is_test:
            passed.append(ok)
    return passed
