"""Planning a pipeline from measurements: `dd.profile` records real steps (`profile`,
`measure`) into a `Profile` (`costs`), which `dd.predict` and `dd.best_schedule`
(`predict`) turn into predicted timelines, bubbles and memory per schedule, and which
``stages=profile`` balances stages by."""
from __future__ import annotations

__all__: list[str] = []
