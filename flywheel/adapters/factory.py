"""The configured artifact store: `artifact_store(settings)` builds the local directory
store (`local.AdapterStore`, the default) or the S3 one (`s3.S3AdapterStore`). Its own
module so the stores' shared vocabulary (`artifacts`) does not import the stores that
import it. No torch; boto3 only when the S3 store is configured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flywheel.adapters.artifacts import ArtifactStore

if TYPE_CHECKING:
    from flywheel.config import Settings


def artifact_store(settings: Settings) -> ArtifactStore:
    """The configured store: a local directory unless `artifacts.backend` is `s3`."""
    if settings.artifacts.backend == "s3":
        from flywheel.adapters.s3 import S3AdapterStore

        return S3AdapterStore.from_settings(settings)
    from flywheel.adapters.local import AdapterStore

    return AdapterStore((settings.trainer.adapters_dir or settings.home / "adapters").resolve())
