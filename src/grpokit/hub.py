"""Uploading the trained model to the Hugging Face Hub (`push_to_hub`, `hub_model_id`, `hub_token`,
`hub_private_repo`, `hub_revision`), as TRL's trainer does at save_model / push_to_hub().

The Hub is checked when the trainer is built, so a run that cannot upload fails at once, not after training.
"""

from __future__ import annotations

import os
from pathlib import Path


def hub_repo_id(args) -> str:
    return args.hub_model_id or Path(args.output_dir).name


def check_hub(args) -> None:
    """Raise a clear error now if the Hub cannot be reached or the token is refused."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false"):
        raise RuntimeError(
            "push_to_hub=True but HF_HUB_OFFLINE is set: the model could not be uploaded. Unset "
            "HF_HUB_OFFLINE, or set push_to_hub=False and upload output_dir later "
            "(huggingface_hub.upload_folder)."
        )
    from huggingface_hub import HfApi

    try:
        HfApi().whoami(token=args.hub_token)
    except Exception as error:  # no network, a refused token, a bad endpoint: all stop the run here
        raise RuntimeError(
            f"push_to_hub=True but the Hugging Face Hub cannot be used ({type(error).__name__}: "
            f"{error}). Log in (`hf auth login`) or pass hub_token, check the network, or set "
            f"push_to_hub=False and upload output_dir later."
        ) from error


def push_folder(args, folder: Path, commit_message: str) -> str:
    """Create the repository if needed and upload `folder`; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=args.hub_token)
    repo = api.create_repo(hub_repo_id(args), private=args.hub_private_repo, exist_ok=True)
    info = api.upload_folder(
        repo_id=repo.repo_id,
        folder_path=str(folder),
        commit_message=commit_message,
        revision=args.hub_revision,
        ignore_patterns=["checkpoint-*", ".tmp-checkpoint-*"],
    )
    return str(getattr(info, "commit_url", info))
