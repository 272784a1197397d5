"""GSM8K grade-school math word problems as a TFDS dataset, read from local jsonl files.

The files follow the TFDS manual-download convention: the caller points
`tfds.download.DownloadConfig(manual_dir=...)` at a folder holding `train.jsonl` and
`test.jsonl` (one `{"question": ..., "answer": ...}` object a line, the final answer after
`#### ` on the last line of `answer`). Nothing is downloaded.

TFDS ships its own `gsm8k` builder (which downloads), registered lazily under the same name.
Registering this one too would make whichever is imported second raise, so this builder is
not registered: construct `Gsm8k(...)` directly (as `tlt_jax.data.pipeline.load_split` does),
not through `tfds.builder("gsm8k")`, which would find the TFDS one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator

import tensorflow_datasets as tfds
from etils import epath

SPLIT_FILES = {"train": "train.jsonl", "test": "test.jsonl"}
DATA_DIR_FLAG = "--config.data.data_dir"
_ANSWER_MARKER = "#### "

MANUAL_DOWNLOAD_INSTRUCTIONS = f"""
Place GSM8K's `train.jsonl` and `test.jsonl` (https://github.com/openai/grade-school-math,
grade_school_math/data/) in one folder and pass that folder with {DATA_DIR_FLAG}=/path/to/gsm8k
(TFDS: `download_config=tfds.download.DownloadConfig(manual_dir=...)`).
"""


def check_manual_dir(manual_dir: str | os.PathLike | None) -> epath.Path:
    """Checks that `manual_dir` holds every split file, before anything is built.

    Args:
      manual_dir: the folder that should hold `train.jsonl` and `test.jsonl`.

    Returns:
      The folder as a path.

    Raises:
      FileNotFoundError: the folder is unset, missing, or lacks a split file; the message
        names the flag to set and the path that was tried.
    """
    if manual_dir is None:
        raise FileNotFoundError(
            f"GSM8K needs a folder with {' and '.join(SPLIT_FILES.values())}; none was given. "
            f"Set {DATA_DIR_FLAG}=/path/to/gsm8k."
        )
    folder = epath.Path(manual_dir).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"GSM8K folder {os.fspath(folder)!r} does not exist. "
            f"Set {DATA_DIR_FLAG} to the folder holding {' and '.join(SPLIT_FILES.values())}."
        )
    for file_name in SPLIT_FILES.values():
        if not (folder / file_name).is_file():
            raise FileNotFoundError(
                f"GSM8K file {os.fspath(folder / file_name)!r} is missing. "
                f"Set {DATA_DIR_FLAG} to the folder holding "
                f"{' and '.join(SPLIT_FILES.values())}."
            )
    return folder


def config_for_files(folder: epath.Path) -> tfds.core.BuilderConfig:
    """Names a build after the content of the split files, so edited files are rebuilt.

    Args:
      folder: a folder that passed `check_manual_dir`.

    Returns:
      A config named `files_<first 12 hex digits of the files' SHA-256>`.
    """
    digest = hashlib.sha256()
    for file_name in sorted(SPLIT_FILES.values()):
        digest.update(file_name.encode())
        digest.update((folder / file_name).read_bytes())
    return tfds.core.BuilderConfig(
        name=f"files_{digest.hexdigest()[:12]}", description=f"built from {os.fspath(folder)}"
    )


def parse_final_answer(solution: str) -> str:
    """Extracts the final answer from a GSM8K solution.

    Args:
      solution: the full `answer` text, ending with a line `#### <answer>`.

    Returns:
      The text after the last `#### `, stripped, with thousands separators removed
      (`"#### 1,234"` gives `"1234"`).

    Raises:
      ValueError: the solution has no `#### ` marker or nothing after it.
    """
    _, marker, tail = solution.rpartition(_ANSWER_MARKER)
    answer = tail.strip().replace(",", "")
    if not marker or not answer:
        raise ValueError(f"no final answer after {_ANSWER_MARKER!r} in solution {solution!r}")
    return answer


def read_jsonl(path: epath.Path) -> Iterator[tuple[int, dict]]:
    """Reads a GSM8K jsonl file into examples.

    Args:
      path: the jsonl file.

    Returns:
      An iterator of `(line_index, {"question", "answer", "solution"})`, blank lines skipped.
      A malformed line (also one that is not UTF-8) raises `ValueError` naming the file and
      line number, and so does a file without examples.
    """
    examples = 0
    with path.open("rb") as file:  # UTF-8 whatever the locale; a bad byte names its line
        for line_index, raw in enumerate(file):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
                record = json.loads(line)
                if not isinstance(record, dict) or not all(
                    isinstance(record.get(key), str) for key in ("question", "answer")
                ):
                    raise ValueError(
                        f"expected an object with string 'question' and 'answer'; got "
                        f"{line.strip()[:80]}"
                    )
                example = {
                    "question": record["question"].strip(),
                    "answer": parse_final_answer(record["answer"]),
                    "solution": record["answer"],
                }
            except (json.JSONDecodeError, KeyError, ValueError) as error:
                raise ValueError(f"{os.fspath(path)}:{line_index + 1}: {error}") from error
            examples += 1
            yield line_index, example
    if not examples:  # TFDS would fail the whole build naming neither the file nor the flag
        raise ValueError(f"GSM8K file {os.fspath(path)!r} holds no examples; set "
                         f"{DATA_DIR_FLAG} to a folder whose split files hold them")  # fmt: skip


class Gsm8k(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """GSM8K from local jsonl files: question, final answer and full solution."""

    name = "gsm8k"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release: question, answer (after ####), solution."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = MANUAL_DOWNLOAD_INSTRUCTIONS
    # TFDS derives this through `importlib_resources`, which it does not declare as a dependency
    # on Python >= 3.9; setting it avoids that import (TFDS looks for `checksums.tsv` beside it).
    code_path = epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        # `dataset_info_from_configs` would read README/CITATIONS files next to this module.
        return tfds.core.DatasetInfo(
            builder=self,
            description="GSM8K grade-school math word problems (Cobbe et al., 2021).",
            features=tfds.features.FeaturesDict(
                {
                    "question": tfds.features.Text(),
                    "answer": tfds.features.Text(),
                    "solution": tfds.features.Text(),
                }
            ),
            supervised_keys=None,
            homepage="https://github.com/openai/grade-school-math",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        folder = check_manual_dir(dl_manager.manual_dir)
        return {
            split: self._generate_examples(folder / file_name)
            for split, file_name in SPLIT_FILES.items()
        }

    def _generate_examples(self, path: epath.Path) -> Iterator[tuple[int, dict]]:
        yield from read_jsonl(path)
