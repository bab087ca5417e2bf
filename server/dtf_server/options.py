"""The launcher's command line: the part of argparse it uses, without importing argparse.

argparse imports re (with enum, functools and collections) and gettext, which imports locale for
each message it would translate: 15 ms of CPU of a launcher command's 45, and every host runs one
for each `up`, `status` and `down`. Only dtf writes a launcher's command line (commands.parser
declares each command's options), so what is needed is small: a command, then options `--name
VALUE` or `--name=VALUE`, each once (or `append`ed to a list), or `store_true` flags; an int or a
float converted; a required one missing, an unknown one, or a bad value is a usage error
(commands.EXIT_USAGE, a line on stderr). No abbreviations and no positional arguments, which no
command takes.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # (typing's, without its import: see dtf_server.protocol)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, NoReturn


class Namespace:
    """The options read, as attributes (argparse.Namespace's part that commands use)."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:  # (for the type checker: any option's name)
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"Namespace({', '.join(f'{k}={v!r}' for k, v in sorted(self.__dict__.items()))})"


class UsageError(Exception):
    pass


class _Option:
    __slots__ = ("action", "default", "dest", "flag", "required", "type")

    def __init__(self, flag: str, dest: str | None, type: Callable[[str], Any] | None, action: str | None,
                 default: Any, required: bool) -> None:
        if not flag.startswith("--") or action not in (None, "append", "store_true"):
            raise ValueError(f"unsupported option {flag} ({action})")
        self.flag, self.action, self.type, self.required = flag, action, type, required
        self.dest = dest or flag[2:].replace("-", "_")
        self.default: Any = False if action == "store_true" and default is None else default


class Command:
    """One command's options (argparse's subparser: add_argument)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.options: dict[str, _Option] = {}

    def add_argument(self, flag: str, *, dest: str | None = None, type: Callable[[str], Any] | None = None,
                     action: str | None = None, default: Any = None, required: bool = False) -> None:
        self.options[flag] = _Option(flag, dest, type, action, default, required)

    def parse(self, argv: list[str]) -> Namespace:
        values: dict[str, Any] = {o.dest: list(o.default) if o.action == "append" else o.default
                                  for o in self.options.values()}
        seen: set[str] = set()
        args = iter(argv)
        for arg in args:
            flag, eq, value = arg.partition("=")
            option = self.options.get(flag)
            if option is None:
                raise UsageError(f"unrecognized argument: {arg}" if arg.startswith("-")
                                 else f"unexpected argument: {arg}")
            seen.add(option.dest)
            if option.action == "store_true":
                if eq:
                    raise UsageError(f"{flag} takes no value")
                values[option.dest] = True
                continue
            if not eq:
                given = next(args, None)
                if given is None:
                    raise UsageError(f"{flag} expects a value")
                value = given
            if option.type is not None:
                try:
                    value = option.type(value)
                except ValueError:
                    raise UsageError(f"{flag}: invalid {option.type.__name__} value: {value!r}") from None
            if option.action == "append":
                values[option.dest].append(value)
            else:
                values[option.dest] = value
        missing = [o.flag for o in self.options.values() if o.required and o.dest not in seen]
        if missing:
            raise UsageError(f"the following arguments are required: {', '.join(missing)}")
        return Namespace(command=self.name, **values)


class Parser:
    """`PROG COMMAND [OPTIONS]`: add_parser declares a command, parse_args reads the command line
    (a usage error: one line on stderr, exit `usage_exit`; --help: the commands, or a command's
    options)."""

    def __init__(self, prog: str, usage_exit: int, doc: str = "") -> None:
        self.prog, self.usage_exit, self.doc = prog, usage_exit, doc
        self.commands: dict[str, Command] = {}

    def add_parser(self, name: str) -> Command:
        self.commands[name] = Command(name)
        return self.commands[name]

    def parse_args(self, argv: list[str]) -> Namespace:
        name = argv[0] if argv else None
        if name in ("-h", "--help") or "-h" in argv[1:] or "--help" in argv[1:]:
            self.help(self.commands.get(name or ""))
        command = self.commands.get(name or "")
        if command is None:
            self.error(f"unknown command {name!r} (one of: {', '.join(self.commands)})" if name
                       else "a command is required")
        try:
            return command.parse(argv[1:])
        except UsageError as e:
            self.error(str(e), command.name)

    def help(self, command: Command | None) -> NoReturn:
        if command is None:
            sys.stdout.write(f"usage: {self.prog} COMMAND [OPTIONS]\n\n{self.doc}")
        else:
            options = " ".join(o.flag if o.action == "store_true" else f"{o.flag} {o.dest.upper()}"
                               for o in command.options.values())
            sys.stdout.write(f"usage: {self.prog} {command.name} {options}\n")
        sys.stdout.flush()
        raise SystemExit(0)

    def error(self, message: str, command: str = "") -> NoReturn:
        """`PROG [COMMAND]: error: MESSAGE` on stderr (as argparse says it), exit `usage_exit`."""
        sys.stderr.write(f"{self.prog}{' ' if command else ''}{command}: error: {message}\n")
        sys.stderr.flush()
        raise SystemExit(self.usage_exit)
