"""Library components as the experiment config's schema: a component is a frozen dataclass whose
fields are declared once, with their defaults and checks, and an ml_collections group supplies
them by name (`from_group`). A component's own error, "<Component>.<field> ...", reaches the user
as "config.<group>.<field> ...".
"""

import contextlib
import dataclasses


@contextlib.contextmanager
def naming_config_fields(groups: dict):
  """Re-raises a component's "<Component>.<field> ..." ValueError as "config.<group>.<field> ..."
  (groups: config group -> component class)."""
  try:
    yield
  except ValueError as e:
    for group, component in groups.items():
      if str(e).startswith(f"{component.__name__}."):
        raise ValueError(f"config.{group}.{str(e)[len(component.__name__) + 1 :]}") from None
    raise


def from_group(component, c, group: str):
  """The dataclass `component` from the experiment config's `group`: every field of the component
  that the group holds, by the same name (the others keep their defaults)."""
  values = {f.name: c[group][f.name] for f in dataclasses.fields(component) if f.name in c[group]}
  with naming_config_fields({group: component}):
    return component(**values)
