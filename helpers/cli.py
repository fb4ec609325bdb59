"""The scripts' command line, which a first reading skips: an Args dataclass becomes argparse flags, each field's
docstring its --help text (CleanRL/tyro style), booleans strict (`--flag`, `--flag true|false`; a typo is an error).
"""
import sys


def field_help(cls):
    """The string under each dataclass field (CleanRL/tyro style) becomes its --help text; subclasses included."""
    import ast
    import inspect
    helps = {}
    for klass in reversed([k for k in cls.__mro__ if k is not object]):
        body = ast.parse(inspect.getsource(klass)).body[0].body
        helps.update({a.target.id: b.value.value.strip() for a, b in zip(body, body[1:])
                      if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)})
    return helps


def boolean(text):
    """A flag's true/false: a typo such as `flase` is an error, not a silent False."""
    import argparse
    low = text.lower()
    if low not in ("1", "true", "yes", "0", "false", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return low in ("1", "true", "yes")


def parse_args(cls, argv=None):
    """Dataclass -> argparse; a bad flag is argparse's one-line usage error."""
    import argparse
    import dataclasses
    doc = (sys.modules[cls.__module__].__doc__ or "").strip().split("\n")[0]
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    helps = field_help(cls)
    for f in dataclasses.fields(cls):
        kind = type(f.default)
        if kind is bool:
            p.add_argument(f"--{f.name}", type=boolean, nargs="?", const=True, default=f.default,
                           help=helps.get(f.name, " "))
        else:
            p.add_argument(f"--{f.name}", type=kind, default=f.default, help=helps.get(f.name, " "))
    return cls(**vars(p.parse_args(argv)))
