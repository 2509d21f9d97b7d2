"""Configs and the command lines that carry them.

`parse_flags` is every tool's flag parser and `run` its `__main__`; `load`
reads a run's `config.json` or a `configs/X.py`; `apply_overrides` parses
`--config.a.b=v` with the same parser, so a sweep's runs resolve (and fail)
exactly as their command lines will.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import traceback
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
from absl import logging
import ml_collections
from ml_collections import config_flags

from otclr_jax import cli

# The flag name `main` defines; overrides are `--config.<dotted field>=<value>`.
FLAG = 'config'


def tuples(value: Any) -> Any:
  """JSON lists back to the tuples the Python configs use (`eval.datasets`)."""
  if isinstance(value, dict):
    return {k: tuples(v) for k, v in value.items()}
  if isinstance(value, list):
    return tuple(tuples(v) for v in value)
  return value


def flatten(tree: dict[str, Any]) -> dict[str, Any]:
  """A nested dict as {dotted name: leaf}: `{'ot': {'b': 1}}` -> `{'ot.b': 1}`;
  JSON round-tripped, so a tuple equals the list it was stored as."""
  flat = {}
  for key, value in json.loads(json.dumps(tree)).items():
    if isinstance(value, dict):
      flat.update({f'{key}.{k}': v for k, v in flatten(value).items()})
    else:
      flat[key] = value
  return flat


def load(path: str) -> ml_collections.ConfigDict:
  """A config from a `configs/X.py` file (`get_config()`) or a JSON dump."""
  if not os.path.exists(path):
    raise FileNotFoundError(f'No config file {path}.')
  if not path.endswith('.py'):
    with open(path) as f:
      try:
        return ml_collections.ConfigDict(tuples(json.load(f)))
      except json.JSONDecodeError as e:
        raise ValueError(f'Config file {path} is not valid JSON: {e}') from e
  spec = importlib.util.spec_from_file_location('_otclr_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def flag_value(value: Any) -> str:
  """A Python value as `config_flags` parses it back (`True` -> `'true'`)."""
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, (tuple, list)):
    return repr(tuple(value))
  return str(value)


def override_flag(override: str | tuple[str, Any]) -> str:
  """One override as the flag `main` takes: `--config.<key>=<value>`.

  Args:
    override: `'--config.ot.epsilon=0.1'` or a pair `('ot.epsilon', 0.1)`.

  Raises:
    ValueError: not of the form key=value.
  """
  if isinstance(override, tuple):
    key, value = override
    return f'--{FLAG}.{key}={flag_value(value)}'
  prefix = f'--{FLAG}.'
  key, sep, _ = override[len(prefix):].partition('=')
  if not override.startswith(prefix) or not sep or not key:
    raise ValueError(
        f'A config override is --{FLAG}.key=value (e.g. '
        f'--{FLAG}.ot.epsilon=0.1), got {override!r}.')
  return override


def apply_overrides(
    config: ml_collections.ConfigDict,
    overrides: Sequence[str | tuple[str, Any]],
) -> ml_collections.ConfigDict:
  """Applies overrides with `main`'s parser to a locked copy of `config`.

  Args:
    config: the base config (left unchanged).
    overrides: `--config.a.b=v` strings or `(key, value)` pairs.

  Returns:
    A new, locked ConfigDict.

  Raises:
    ValueError: an unknown field (close names suggested), a value of the
      wrong type, or a malformed override.
  """
  argv = ['otclr_jax'] + [override_flag(o) for o in overrides]
  flag_values = flags.FlagValues()
  try:
    # sys_argv: override names come from `argv`, not the real command line.
    config_flags.DEFINE_config_dict(
        FLAG, config.copy_and_resolve_references(), flag_values=flag_values,
        lock_config=True, sys_argv=argv)
    flag_values(argv)
  except (AttributeError, KeyError, flags.Error) as e:
    detail = str(e.args[0]) if e.args else str(e)
    raise ValueError(
        f'Bad config override in {argv[1:]}: {detail} (fields are those of '
        'the config file; see configs/default.py).') from e
  return flag_values[FLAG].value


_ASSIGNMENT = re.compile(r'^\s*config\.([\w.]+)\s*=[^#]*?(?:#\s*(.*))?$')


def _comments(path: str, prefix: str = '') -> dict[str, str]:
  """{dotted field: its comment} of a file's `config.<field> = ...` lines:
  the comment on the line, else the comment lines just above it."""
  comments, above = {}, []
  with open(path) as f:
    for line in f:
      stripped = line.strip()
      if stripped.startswith('#'):
        above.append(stripped.lstrip('# ').strip())
        continue
      match = _ASSIGNMENT.match(line)
      if match:
        text = match.group(2) or ' '.join(above)
        if text:
          comments[prefix + match.group(1)] = text
      above = []
  return comments


def describe(config: ml_collections.ConfigDict) -> str:
  """Every field of `config` with its value and its comment in
  configs/default.py or its method's module: `--helpconfig`'s text."""
  package = os.path.dirname(os.path.abspath(__file__))
  comments = {}
  for name in sorted(os.listdir(os.path.join(package, 'methods'))):
    if name.endswith('.py') and not name.startswith(('_', 'base')):
      comments.update(_comments(os.path.join(package, 'methods', name),
                                f'{name[:-3]}.'))
  default = os.path.join(os.path.dirname(package), 'configs', 'default.py')
  if os.path.exists(default):
    comments.update(_comments(default))
  lines = []
  for name, value in flatten(config.to_dict()).items():
    comment = comments.get(name, '')
    lines.append(f'  --{FLAG}.{name}={flag_value(value)}'
                 + (f'\n      {comment}' if comment else ''))
  return ('Config fields (override any as --config.<field>=<value>); values '
          'are this config\'s:\n' + '\n'.join(lines))


class UsageError(cli.UsageError):
  """A bad command line: an unknown flag or field, or a bad value."""


def _parse_into(flag_values: flags.FlagValues,
                argv: Sequence[str]) -> list[str]:
  """`flag_values(argv)`: the arguments left, program name first.

  Raises:
    UsageError: one line naming the bad flag, field, value or config file.
  """
  try:
    rest = flag_values(argv)
    config = flag_values[FLAG].value if FLAG in flag_values else None
    if config is not None:
      config.keys()  # A config file that failed to load says so when read.
  except Exception as e:  # pylint: disable=broad-except
    detail = str(e.args[0]) if e.args else str(e)
    path = ([a.split('=', 1)[1] for a in argv if a.startswith(f'--{FLAG}=')]
            or [''])[-1]
    in_file = os.path.isfile(path) and any(
        os.path.exists(f.filename) and os.path.samefile(f.filename, path)
        for f in traceback.extract_tb(e.__traceback__))
    if (in_file or 'parsing config file' in detail or isinstance(e, OSError)
        or not isinstance(e, (flags.Error, AttributeError, KeyError))):
      # Raised by loading or running the config file: the user's input too.
      if not isinstance(e, (flags.Error, OSError)):
        detail = re.sub(r' Other fields present: .*}"', '',
                        f'{type(e).__name__}: {e}')
      detail = (f'cannot load --{FLAG}={path} (a Python config file): '
                f'{detail.strip().splitlines()[-1].strip()}')
    detail = detail.replace('\\n', ' ').replace("\\'", "'")
    if len(detail) > 1 and detail[0] == detail[-1] == "'":
      detail = f'unknown config field {detail[1:-1]}'
    raise UsageError(' '.join(detail.split())) from None
  return rest


def overrides_of(argv: Sequence[str]) -> list[str]:
  """The `--config.a.b=v` overrides of a command line, to pass on to a job.

  Raises:
    UsageError: an override in another absl spelling (`--noconfig.a.b`,
      `--config.a.b v`), which a job's command line would drop or misread.
  """
  out = []
  for arg in argv[1:]:
    if arg.lstrip('-').startswith((f'{FLAG}.', f'no{FLAG}.')):
      if not arg.startswith(f'--{FLAG}.') or '=' not in arg:
        raise UsageError(f'{arg}: give config overrides as --{FLAG}.a.b=v '
                         '(jobs run them as written).')
      out.append(arg)
  return out


def parse_flags(
    argv: Sequence[str],
    define: Callable[[flags.FlagValues, list[str]], None],
    doc: str = '',
) -> tuple[flags.FlagValues, list[str]] | None:
  """Every tool's command line, absl style, on the tool's own FlagValues.

  `define(flag_values, argv)` defines the flags (the config with
  `sys_argv=argv`); own FlagValues let tools share one process (the tests).
  absl's logging flags (`-v`, `--logtostderr`) come along; a tool with a
  --config also takes `--helpconfig`.

  Args:
    argv: the command line, program name first (as `sys.argv`).
    define: defines the flags.
    doc: printed above the flags for `--help`.

  Returns:
    `(flag_values, positional arguments without the program name)`, or None
    when `--help` or `--helpconfig` was asked for (the help is printed).

  Raises:
    UsageError: one line naming the bad flag, field, value or config file.
  """
  argv = list(argv)
  flag_values = flags.FlagValues()
  define(flag_values, argv)
  if FLAG in flag_values:
    flags.DEFINE_bool('helpconfig', False, 'List every field of --config '
                      'with its value and comment, then exit.',
                      flag_values=flag_values)
  for flag in flags.FLAGS.get_flags_for_module(logging.__name__):
    flag_values[flag.name] = flag  # and its short name
  if any(a in ('-h', '--help', '-help') for a in argv[1:]):
    print(f'{doc.strip()}\n\nFlags:\n{flag_values.get_help()}')
    return None
  rest = _parse_into(flag_values, argv)[1:]
  if FLAG in flag_values and flag_values.helpconfig:
    if flag_values[FLAG].value is None:
      raise UsageError(f'--helpconfig describes a config: give '
                       f'--{FLAG}=configs/<name>.py too.')
    print(describe(flag_values[FLAG].value))
    return None
  return flag_values, rest


def run(main: Callable[[Sequence[str]], Any],
        usage_errors: tuple[type[BaseException], ...] = ()) -> None:
  """A tool's `__main__`: absl's `app.run` around `main(argv)`, which parses
  its flags with `parse_flags`; exits with `cli`'s status table.

  Args:
    main: the tool's `main(argv) -> status`.
    usage_errors: further exception types that are usage errors for it.
  """

  def parsed_by_main(argv):
    flags.FLAGS.mark_as_parsed()  # absl's own flags: parsed by `parse_flags`
    return list(argv)

  def guarded(argv):
    # Before absl's `app.run` sees it: expected failures end in one line, and
    # a failure's exit skips the runtime's shutdown.
    status = cli.call(main, argv, usage_errors)
    if status:
      cli.exit_now(status)
    return status

  cli.run(lambda argv: app.run(guarded, argv=argv,
                               flags_parser=parsed_by_main))
