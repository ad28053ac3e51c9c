"""`sluice export --push-to-hub REPO`: upload an exported folder with `huggingface_hub`.

Checked before anything is exported (`check_hub_ready`): offline mode and a missing
token fail with a message, not a traceback. The upload itself (``create_repo`` +
``upload_folder``) is not exercised by the tests, which never reach the network.
"""

from __future__ import annotations

import os
from pathlib import Path


class HubError(ValueError):
    """The folder cannot be pushed: offline, no token, or the hub refused (exit 2)."""


def check_hub_ready() -> str:
    """The token to push with; raises `HubError` (not a traceback) when offline or
    logged out, before anything is exported."""
    import huggingface_hub
    from huggingface_hub import constants

    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    if offline or constants.HF_HUB_OFFLINE:
        raise HubError("--push-to-hub: HF_HUB_OFFLINE is set, so nothing can be pushed; "
                          "unset it (or export without --push-to-hub and upload later)")
    token = huggingface_hub.get_token()
    if not token:
        raise HubError("--push-to-hub: no Hugging Face token; run `hf auth login` or "
                          "set HF_TOKEN")
    return token


def push_to_hub(folder: Path, repo: str, token: str) -> str:
    """Create ``repo`` (a model repo, kept if it exists) and upload ``folder``; the
    commit's URL. Hub and network errors become `HubError`."""
    from huggingface_hub import create_repo, upload_folder

    try:
        create_repo(repo, token=token, repo_type="model", exist_ok=True)
        info = upload_folder(repo_id=repo, folder_path=str(folder), token=token,
                             repo_type="model", commit_message="sluice export")
    except Exception as e:  # hub HTTP errors, connection errors, bad repo ids
        raise HubError(f"--push-to-hub {repo}: {type(e).__name__}: {e} (the folder "
                          f"{folder} is written; upload it later)") from None
    return str(getattr(info, "commit_url", info))
