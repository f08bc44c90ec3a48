"""A `launcher.preload` module for tests: every hot spare of the job hangs before it says it is ready, as a spare
whose node is too slow to start it would. The ranks are untouched."""

from __future__ import annotations

import os
import time
from typing import Any

from nemo_checkpointless import protocol
from nemo_checkpointless.restart import session as _session

_from_environ = _session.Session.from_environ.__func__  # type: ignore[attr-defined]


def _stuck_if_spare(cls: Any, *args: Any, **kwargs: Any) -> Any:
    if protocol.SPARE_ID_ENV in os.environ:
        print(f"stuck_spare: spare {os.environ[protocol.SPARE_ID_ENV]} hangs before it is ready", flush=True)
        while True:
            time.sleep(1)
    return _from_environ(cls, *args, **kwargs)


_session.Session.from_environ = classmethod(_stuck_if_spare)  # type: ignore[method-assign, assignment]
