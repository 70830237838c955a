"""Library components as the experiment config's schema: a component is a frozen dataclass whose
fields are declared once, with their defaults and checks, and ml_collections groups supply them by
name (`from_group`). A component's own error, "<Component>.<field> ...", reaches the user as
"config.<group>.<field> ...".
"""

import contextlib
import dataclasses
import re


@contextlib.contextmanager
def naming_config_fields(groups: dict):
  """Re-raises a component's "<Component>.<field> ..." ValueError as "config.<group>.<field> ..."
  (groups: config group -> component class, or -> (component class, {field: its group}) where a
  component's fields come from several groups)."""
  try:
    yield
  except ValueError as e:
    for group, component in groups.items():
      component, where = component if isinstance(component, tuple) else (component, {})
      prefix = f"{component.__name__}."
      if str(e).startswith(prefix):
        rest = str(e)[len(prefix) :]
        field = re.match(r"\w*", rest).group()
        raise ValueError(f"config.{where.get(field, group)}.{rest}") from None
    raise


def from_group(component, c, *groups: str):
  """The dataclass `component` from the experiment config's `groups`: every field of the component
  that one of them holds, by the same name, from the first that holds it (the others keep their
  defaults)."""
  where = {}
  for group in reversed(groups):
    where.update({f.name: group for f in dataclasses.fields(component) if f.name in c[group]})
  values = {name: c[group][name] for name, group in where.items()}
  with naming_config_fields({groups[0]: (component, where)}):
    return component(**values)
