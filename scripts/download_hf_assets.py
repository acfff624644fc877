"""Download a Hugging Face hub model's tokenizer, config and/or safetensors weights for training.

    python scripts/download_hf_assets.py meta-llama/Meta-Llama-3.1-8B --assets tokenizer [config safetensors]
        [--local-dir assets/hf/Meta-Llama-3.1-8B] [--revision main] [--hf-token TOKEN]

Point ``model.hf_assets_path`` at the folder it prints. Gated repositories (e.g. meta-llama) need a
token: ``--hf-token`` or the HF_TOKEN environment variable, from an account that accepted the license.

Nothing already in the folder is overwritten: a file of the repository that is already there must be one an
earlier download put there and nobody changed since (the hub's own record of it, under .cache/huggingface);
anything else is refused before the download starts. So the folder can be topped up (``--assets safetensors``
after ``--assets tokenizer``), but a file of the user's with a repository file's name is left alone.
"""

from __future__ import annotations

import argparse
import fnmatch
import pathlib
import sys

# Let the script run from a checkout without installing the package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from torchtitan.script_args import ScriptParser  # noqa: E402

# The files each asset kind consists of, as hub file patterns.
ASSET_PATTERNS = {
    "tokenizer": ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json"],
    "config": ["config.json", "generation_config.json"],
    "safetensors": ["*.safetensors", "model.safetensors.index.json"],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line: a repository id and what to fetch."""
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo_id", help="hub repository, e.g. meta-llama/Meta-Llama-3.1-8B")
    parser.add_argument("--assets", nargs="+", choices=sorted(ASSET_PATTERNS), default=["tokenizer"],
                        help="what to download (default: tokenizer)")
    parser.add_argument("--local-dir", type=pathlib.Path, help="destination (default: assets/hf/<repository name>)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument("--hf-token", default=None, help="access token for gated repos (default: $HF_TOKEN)")
    args = parser.parse_args(argv)
    if args.repo_id.count("/") != 1 or not all(args.repo_id.split("/")):
        parser.error(f"repo_id {args.repo_id!r} is invalid; expected 'owner/name'")
    if args.local_dir is None:
        args.local_dir = pathlib.Path("assets/hf") / args.repo_id.split("/")[1]
    return args


class ExistingFileError(Exception):
    """A file of the repository is already in the folder and was not put there by an earlier download."""


def foreign_files(local_dir: pathlib.Path, names: list[str], commit: str) -> list[str]:
    """Which of the repository files ``names`` (at ``commit``) are in ``local_dir`` but were not left there, as
    they are, by an earlier download of that commit: a user's file, an edited one, or another repository's or
    revision's (the hub records only the commit a file came from)."""
    present = [name for name in names if (local_dir / name).exists()]
    if not present:
        return []
    if not (local_dir / ".cache" / "huggingface").is_dir():
        return present  # no download ever wrote here
    try:
        from huggingface_hub._local_folder import read_download_metadata
    except ImportError:  # a huggingface_hub that keeps its records elsewhere: trust none
        return present

    # None when the hub has no record of the file, or it was modified after it was downloaded.
    return [name for name in present
            if getattr(read_download_metadata(local_dir, name), "commit_hash", None) != commit]


def download(repo_id: str, assets: list[str], local_dir: pathlib.Path, revision: str | None,
             token: str | None) -> list[str]:
    """Download the asset files of repo_id into local_dir; return the files fetched. ExistingFileError (before
    anything is written) when one of them is already there and is not an earlier download's of this commit."""
    from huggingface_hub import HfApi, snapshot_download

    patterns = [pattern for asset in assets for pattern in ASSET_PATTERNS[asset]]
    if local_dir.is_dir() and any(local_dir.iterdir()):
        info = HfApi().model_info(repo_id, revision=revision, token=token)
        names = [s.rfilename for s in info.siblings or []
                 if any(fnmatch.fnmatch(s.rfilename, pattern) for pattern in patterns)]
        if foreign := foreign_files(local_dir, names, info.sha):
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise ExistingFileError(f"--local-dir {local_dir} already holds {foreign[0]!r}{more}, which this download "
                                    f"would overwrite and which no earlier download of {repo_id} at this revision "
                                    "left there unchanged; give another --local-dir (or move the file away)")
        revision = info.sha  # the commit judged above, not a branch that may move meanwhile
    snapshot_download(repo_id, revision=revision, allow_patterns=patterns, local_dir=local_dir, token=token)
    return sorted(str(p.relative_to(local_dir)) for p in local_dir.rglob("*")
                  if p.is_file() and ".cache" not in p.relative_to(local_dir).parts)


def main(argv: list[str] | None = None) -> int:
    """Download, then print the folder to use as model.hf_assets_path; one-line error and exit 1 on failure."""
    args = parse_args(argv)
    if args.local_dir.exists() and not args.local_dir.is_dir():
        print(f"error: --local-dir {args.local_dir} is an existing file; give a folder", file=sys.stderr)
        return 2
    try:
        files = download(args.repo_id, args.assets, args.local_dir, args.revision, args.hf_token)
    except ExistingFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # network, authentication, unknown repo: all need the same one-line report
        reason = (str(e).strip().splitlines() or [""])[0]
        print(f"error: cannot download {', '.join(args.assets)} of {args.repo_id!r} from the Hugging Face hub: "
              f"{type(e).__name__}: {reason} (check the network, HF_HUB_OFFLINE, and HF_TOKEN for gated repos)",
              file=sys.stderr)
        return 1
    if not files:
        print(f"error: {args.repo_id!r} has no files for {', '.join(args.assets)}", file=sys.stderr)
        return 1
    print(f"downloaded {len(files)} files to {args.local_dir}: {', '.join(files)}")
    print(f"use: --model.hf_assets_path {args.local_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
