"""Compose the job's config with Hydra's compose API and turn every composition error into one clear message.

Recipes are YAML files in `recipes/`; each is registered as an option of the config group `recipe`, so users
write `recipe=llama3_8b` and override any key as `section.key=value`.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from nemo_checkpointless.config import Config, register_configs, to_object
from nemo_checkpointless.errors import ConfigError

_PKG_ROOT = Path(__file__).resolve().parents[1]


def _data_dir(repo_name: str, installed_name: str) -> Path:
    """The YAML folder `installed_name` inside the installed package (a wheel: nemo_checkpointless/_conf), else
    `repo_name` beside the package (a source checkout or an editable install: conf/, recipes/)."""
    installed = _PKG_ROOT / installed_name
    return installed if installed.is_dir() else _PKG_ROOT.parent / repo_name


def conf_dir() -> Path:
    return _data_dir("conf", "_conf")


def recipes_dir() -> Path:
    return _data_dir("recipes", "_recipes")


def recipe_names() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def _register_recipes() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    for path in sorted(recipes_dir().glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


def _keys_of(section: str) -> list[str]:
    from omegaconf import DictConfig, OmegaConf

    node: Any = OmegaConf.structured(Config)
    for part in [p for p in section.split(".") if p]:
        node = node.get(part) if isinstance(node, DictConfig) else None
    return [str(k) for k in node] if isinstance(node, DictConfig) else []


def _override_for(overrides: list[str], key: str) -> str:
    for o in overrides:
        if o.lstrip("+~").split("=", 1)[0] == key:
            return o.split("=", 1)[1] if "=" in o else ""
    return "?"


def _explain(e: Exception, overrides: list[str]) -> ConfigError:
    """Map a Hydra/OmegaConf composition error to a ConfigError naming the key, value, rule and fix."""
    msg = f"{e}\n{e.__cause__ or ''}"
    if m := re.search(r"Could not find '(?:recipe/)?([^']+)'", msg):
        name = m.group(1)
        close = difflib.get_close_matches(name, recipe_names(), n=1)
        hint = f"did you mean recipe={close[0]}? " if close else ""
        return ConfigError("recipe", name, "no such recipe", f"{hint}choose one of: {', '.join(recipe_names())}")
    if m := re.search(r"Key '([^']+)' not in '(\w+)'", msg) or re.search(r"Key '([^']+)' is not in struct", msg):
        full = re.search(r"full_key: (\S+)", msg)
        key = full.group(1) if full else m.group(1)
        section, _, leaf = key.rpartition(".")
        known = _keys_of(section)
        close = difflib.get_close_matches(leaf, known, n=1)
        hint = f"did you mean {section + '.' if section else ''}{close[0]}? " if close else ""
        where = f"under {section}" if section else "at the top level"
        return ConfigError(key, _override_for(overrides, key), f"no such key {where}",
                           f"{hint}known keys: {', '.join(known)}")
    if m := re.search(r"Value '([^']*)' (?:of type '\w+' )?could not be converted to (\w+)", msg):
        full = re.search(r"full_key: (\S+)", msg)
        key = full.group(1) if full else "?"
        return ConfigError(key, m.group(1), f"must be of type {m.group(2).lower()}", "fix the value's type")
    if "mismatched input" in msg or "no viable alternative" in msg or "extraneous input" in msg:
        return ConfigError("override", " ".join(overrides), "is not valid override syntax",
                           "write key=value, e.g. trainer.max_steps=40 or 'fault.plan=[{kind:kill,rank:1,step:12}]'")
    first = msg.strip().splitlines()[0] if msg.strip() else type(e).__name__
    return ConfigError("config", " ".join(overrides), first, "check the override")


SCRIPT_ARGS_EXAMPLE = "'script_args=[--max-steps,8]'"


def _list_elements(inner: str) -> list[str] | None:
    """The elements of a list override's text between its brackets, each as written (a quoted one without its
    quotes); None where that text is more than plain or quoted strings (nested lists, interpolations, escapes):
    Hydra then reads it itself."""
    out: list[str] = []
    i, n = 0, len(inner)
    if not inner.strip():
        return out
    while True:
        while i < n and inner[i].isspace():
            i += 1
        if i < n and inner[i] in "'\"":
            end = inner.find(inner[i], i + 1)
            if end < 0 or "\\" in inner[i + 1:end]:
                return None
            element, i = inner[i + 1:end], end + 1
            while i < n and inner[i].isspace():
                i += 1
        else:
            end = inner.find(",", i)
            end = n if end < 0 else end
            element, i = inner[i:end].strip(), end
            if not element or any(c in element for c in "[]{}()'\"\\$"):
                return None
        out.append(element)
        if i >= n:
            return out
        if inner[i] != ",":
            return None
        i += 1


def _script_args(override: str) -> str:
    """`script_args=[...]` with every element quoted, so each reaches the script exactly as written (Hydra alone
    would read 8 as an int, 3e-3 as 0.003 and true as True; and refuse --lr=3e-3 unquoted)."""
    key, _, value = override.partition("=")
    text = value.strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise ConfigError("script_args", value, "must be a list: the script's arguments, in brackets",
                          f"write e.g. {SCRIPT_ARGS_EXAMPLE} (quoted for the shell)")
    elements = _list_elements(text[1:-1])
    if elements is None:
        return override
    quoted = [f'"{e}"' if "'" in e else f"'{e}'" for e in elements]  # an element holds one kind of quote at most
    return f"{key}=[{','.join(quoted)}]"


def compose(overrides: list[str]) -> Config:
    """The validated `Config` for these command-line overrides; raises ConfigError (never a Hydra traceback)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf.errors import OmegaConfBaseException

    bad = [o for o in overrides if "=" not in o]
    if bad:
        fix = (f"a script's own arguments go in script_args=[...], e.g. {SCRIPT_ARGS_EXAMPLE}" if bad[0].startswith("-")
               else "write e.g. trainer.max_steps=40 (see --help)")
        raise ConfigError("override", bad[0], "is not of the form key=value", fix)
    overrides = [_script_args(o) if o.lstrip("+").split("=", 1)[0] == "script_args" else o for o in overrides]
    register_configs()
    _register_recipes()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="checkpointless"):
            node = hydra_compose(config_name="config", overrides=overrides)
        return to_object(node)
    except ConfigError:
        raise
    except (OmegaConfBaseException, Exception) as e:
        cause = e.__cause__ or e.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise _explain(e, overrides) from None
    finally:
        GlobalHydra.instance().clear()
