"""Chat data for supervised fine-tuning: conversations rendered with the tokenizer's chat template, packed
whole into rows, with loss on the assistant's tokens only.

A conversation (a list of {"role", "content"} messages, the format of most public SFT sets) becomes the
ids of its rendered text (data/chat_template.py) and labels that are IGNORE_INDEX except where the next
token is the assistant's (or everywhere, with train_on = "all"). Conversations are never split across
rows: they go into a row one after another until the next one does not fit, and the rest of the row is
padding (ignored labels, a document of its own). A conversation longer than seq_len is cut to seq_len
tokens or left out, as ``overlong`` says, and counted. Each conversation is one document of the row, so
block-causal attention keeps it apart from its neighbours.

Layout independence and resuming work as for text (data/dataset.py): the rows form one global stream,
a rank's micro-batch takes rows r, r + dp, ... of the next local_batch x dp rows (a round), every round
starts with a fresh row, and the position after a round is the first conversation it did not place.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from torchtitan.data.chat_template import ChatTemplate, ChatTemplateError, assistant_token_mask, chat_ids
from torchtitan.data.dataset import IGNORE_INDEX, ImageBatch, StreamPosition, stacked_batch
from torchtitan.data.errors import DataError
from torchtitan.data.image_chat import EncodedImageChat, ImageChat, ImageRows
from torchtitan.data.pydocs import load_pydocs_documents
from torchtitan.data.tokenizer import Tokenizer
from torchtitan.log import logger

OVERLONG = ("truncate", "drop")
TRAIN_ON = ("assistant", "all")


def check_messages(messages: object, where: str, parts: bool = False) -> None:
    """Raise DataError (one line, naming ``where``) unless ``messages`` is a list of {role, content} messages.

    Which roles exist is the template's business (as in transformers): ours knows system, user and assistant
    and raises for others; content may be None (e.g. a tool-call turn), which the template sees as absent. With
    ``parts`` (image conversations) content may also be a list of {"type": ...} parts, as transformers writes it.
    """
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}}, got {messages!r:.60}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: message {i} must be a dict with 'role' and 'content', got {message!r:.60}")
        if not isinstance(message["role"], str) or not message["role"]:
            raise DataError(f"{where}: message {i} has role {message['role']!r}; a role is a non-empty string")
        content = message["content"]
        if parts and isinstance(content, list):
            if all(isinstance(part, dict) and isinstance(part.get("type"), str) for part in content):
                continue
            raise DataError(f"{where}: message {i} content is a list whose items are not all {{'type': ...}} parts, "
                            f"got {content!r:.60}")
        if content is not None and not isinstance(content, str):
            raise DataError(f"{where}: message {i} content is {type(content).__name__}, not text"
                            + (" or a list of parts" if parts else ""))


def encode_conversation(tokenizer: Tokenizer, template: ChatTemplate, messages: list[dict],
                        train_on: str = "assistant") -> tuple[np.ndarray, np.ndarray]:
    """(input ids, labels) of one conversation: ids[:-1] and the next tokens, ignored outside the trained ones."""
    if train_on == "all":  # no mask needed, so nothing to locate
        ids = np.asarray(chat_ids(tokenizer, template, messages), dtype=np.int64)
        return ids[:-1], ids[1:].copy()
    ids, mask = assistant_token_mask(tokenizer, template, messages)
    ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
    labels = ids[1:].copy()
    labels[~mask[1:]] = IGNORE_INDEX
    return ids[:-1], labels


@dataclass(frozen=True)
class _PassEnd:
    """Marks the end of a pass over the conversations: whether it began at the first one, and how many it read."""

    whole: bool
    conversations: int


class PackedChatDataset(IterableDataset):
    """One data-parallel rank's micro-batches of packed conversations (see the module doc).

    Yields ``(batch, state)``: the `Batch` fields stacked (4, local_batch_size, seq_len) and ``{"position": the
    StreamPosition after the round, "counts": {"conversations_truncated": n, "conversations_dropped": n} of the
    round}``, identical on every rank.
    """

    def __init__(self, conversations: Iterable, tokenizer: Tokenizer, seq_len: int, local_batch_size: int = 1,
                 dp_rank: int = 0, dp_world_size: int = 1, infinite: bool = True, label: str = "conversations",
                 train_on: str = "assistant", overlong: str = "truncate", template: ChatTemplate | None = None,
                 images: ImageChat | None = None):
        if iter(conversations) is conversations:
            raise TypeError("conversations must be re-iterable (e.g. a list), not a one-shot iterator")
        for name, value, valid in (("training.chat.overlong", overlong, OVERLONG),
                                   ("training.chat.train_on", train_on, TRAIN_ON)):
            if value not in valid:
                raise ValueError(f"{name} = {value!r} is invalid; valid: {', '.join(valid)}")
        for name, value in (("seq_len", seq_len), ("local_batch_size", local_batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank must be in [0, {dp_world_size}) for dp_world_size={dp_world_size}, "
                             f"got {dp_rank}")
        if template is None:
            if tokenizer.chat_template is None:
                raise DataError("chat data needs a chat template, and the tokenizer has none (no chat_template in "
                                "its tokenizer_config.json); use a tokenizer folder that has one")
            try:
                template = ChatTemplate(tokenizer.chat_template)
            except ChatTemplateError as e:
                raise DataError(f"the tokenizer's chat template is invalid: {e}") from None
        self.conversations, self.tokenizer, self.template = conversations, tokenizer, template
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.infinite, self.label, self.train_on, self.overlong = infinite, label, train_on, overlong
        self.images = images  # image conversations (data/image_chat.py), for a vision-language model
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        self.start = StreamPosition()

    def _where(self, index: int) -> str:
        # Files name the file and the row in it (sources.LocalFiles.locate); other sources their own row.
        locate = getattr(self.conversations, "locate", None)
        return locate(index) if locate is not None else f"dataset {self.label}: row {index}"

    def _encoded(self, start: StreamPosition
                 ) -> Iterator[tuple[int, int, np.ndarray, np.ndarray, EncodedImageChat | None] | _PassEnd]:
        """Each conversation as (epoch, index, inputs, labels, its images or None), and a _PassEnd after each pass
        over the data."""
        epoch, first = start.epoch, start.document
        while True:
            count = 0
            for index, row in itertools.islice(enumerate(self.conversations), first, None):
                where = self._where(index)
                messages, sources = self.images.split_row(row, where) if self.images else (row, [])
                check_messages(messages, where, parts=self.images is not None)
                try:
                    inputs, labels = encode_conversation(self.tokenizer, self.template, messages, self.train_on)
                except ChatTemplateError as e:
                    raise DataError(f"{where}: {e}") from None
                encoded = None
                if self.images is not None:
                    file = getattr(self.conversations, "file_of", lambda _: None)(index)
                    folder = file.parent if file is not None else None
                    encoded = self.images.encode(inputs, labels, sources, where, folder, self.seq_len)
                    inputs, labels = encoded.inputs, encoded.labels
                count += 1
                yield epoch, index, inputs, labels, encoded
            yield _PassEnd(whole=first == 0, conversations=count)
            if not self.infinite:
                return
            epoch, first = epoch + 1, 0

    def _check_pass(self, end: _PassEnd, placed: int, trained: int) -> None:
        """Refuse data that a whole pass shows can never train: it would cycle forever, or at loss 0."""
        if not end.whole:
            return
        if not end.conversations:
            raise DataError(f"dataset {self.label} has no conversations")
        if not placed:
            raise DataError(f"dataset {self.label}: no conversation fits a row of seq_len {self.seq_len} tokens with "
                            f"training.chat.overlong = {self.overlong!r}; raise seq_len or use overlong = 'truncate'")
        if self.train_on == "assistant" and not trained:
            raise DataError(
                f"dataset {self.label}: none of its {end.conversations} conversations has an assistant token to train "
                f"on (an 'assistant' message the chat template renders, within seq_len {self.seq_len}), so every "
                "step's loss would be 0; add assistant replies or set training.chat.train_on = 'all'")

    def _rounds(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, StreamPosition, dict, ImageRows | None]]:
        """(tokens, labels, document ids) of each round's rows, the position after it, its counts and its rows'
        image fields (image conversations)."""
        source = self._encoded(self.start)
        pending, after = None, self.start
        placed_in_pass = trained_in_pass = 0  # conversations placed and tokens trained since the pass began
        warned = self.train_on == "all"
        rows_per_round = self.local_batch_size * self.dp_world_size
        while True:
            counts = {"conversations_truncated": 0, "conversations_dropped": 0}
            tokens = np.full((rows_per_round, self.seq_len), self.pad_id, dtype=np.int64)
            labels = np.full((rows_per_round, self.seq_len), IGNORE_INDEX, dtype=np.int64)
            ids = np.zeros((rows_per_round, self.seq_len), dtype=np.int64)
            image_rows = (ImageRows(rows_per_round, self.seq_len, self.images.image_token_id) if self.images
                          else None)
            for row in range(rows_per_round):
                used, document = 0, 0
                while True:
                    if pending is None:
                        pending = next(source, None)
                        if pending is None:
                            break
                        if isinstance(pending, _PassEnd):
                            self._check_pass(pending, placed_in_pass, trained_in_pass)
                            pending, placed_in_pass, trained_in_pass = None, 0, 0
                            continue
                    epoch, index, inputs, targets, encoded = pending
                    rendered = len(inputs)  # before any cut
                    if encoded is not None and len(inputs) > self.seq_len and self.overlong == "truncate":
                        encoded = encoded.cut(self.seq_len, self.images.image_token_id)  # never inside an image
                        inputs, targets = encoded.inputs, encoded.labels
                    too_many_images = encoded is not None and self.images.too_many_image_tokens(encoded)
                    if (len(inputs) == 0 or (len(inputs) > self.seq_len and self.overlong == "drop")
                            or too_many_images):
                        # An empty rendering trains nothing; a conversation cut to nothing does count.
                        counts["conversations_dropped"] += rendered > 0
                        pending, after = None, StreamPosition(epoch, index + 1)
                        continue
                    length = min(len(inputs), self.seq_len)
                    if used + length > self.seq_len:
                        break
                    counts["conversations_truncated"] += rendered > self.seq_len
                    tokens[row, used:used + length] = inputs[:length]
                    labels[row, used:used + length] = targets[:length]
                    ids[row, used:used + length] = document
                    if image_rows is not None:
                        image_rows.place(row, used, encoded)
                    used, document = used + length, document + 1
                    pending, after = None, StreamPosition(epoch, index + 1)
                    placed_in_pass += 1
                    trained_in_pass += int(np.count_nonzero(targets[:length] != IGNORE_INDEX))
                if used == 0:
                    return  # the data ended (only without infinite): the partial round is dropped
                ids[row, used:] = document  # the padding is a document of its own
                if image_rows is not None:
                    image_rows.pad(row, used)
            if not warned and not (labels != IGNORE_INDEX).any():
                # The pass's end refuses data with nothing to train; a large source should not train silently
                # at loss 0 until then.
                logger.warning(f"dataset {self.label}: the first batch has no assistant token to train on "
                               "(training.chat.train_on = 'assistant'); its loss is 0")
            warned = True
            position = StreamPosition(pending[0], pending[1]) if pending is not None else after
            yield tokens, labels, ids, position, counts, image_rows

    def __iter__(self) -> Iterator[tuple[torch.Tensor, dict]]:
        worker = get_worker_info()
        worker_id, num_workers = (0, 1) if worker is None else (worker.id, worker.num_workers)
        mine = slice(self.dp_rank, None, self.dp_world_size)
        for step, (tokens, labels, ids, position, counts, image_rows) in enumerate(self._rounds()):
            if step % num_workers == worker_id:
                batch = stacked_batch(tokens[mine], labels[mine], ids[mine])
                if image_rows is not None:  # M-RoPE positions and the images added
                    batch = ImageBatch(*batch[:3], *image_rows.fields(mine, self.images.patching.patch_dim))
                yield batch, {"position": position.state_dict(), "counts": counts}


# ----------------------------------------------------------------------------------------------------------
# pydocs_chat: questions and answers made from the Python standard library's docstrings
# ----------------------------------------------------------------------------------------------------------

_QUESTIONS = ("What does `{name}` do?", "Explain `{name}`.", "What is `{name}` for?",
              "I found `{name}` in the standard library. What does it do?")
_SYSTEM = "You are a concise assistant who answers questions about the Python standard library."


def _qa_pairs(document: str) -> list[tuple[str, str]]:
    """(definition, first docstring paragraph) of each documented def or class of a pydocs module document."""
    pairs = []
    for section in document.split("\n\n"):
        header, _, answer = section.partition("\n")
        if header.startswith(("def ", "class ")) and answer.strip() and not answer.startswith(" "):
            name = header.split(" ", 1)[1]
            pairs.append((name if len(name) <= 80 else name.split("(", 1)[0] + "(...)", answer.strip()))
    return pairs


def load_pydocs_chat(split: str = "train") -> list[list[dict]]:
    """Conversations asking about documented functions and classes of the pydocs corpus (same splits): one or
    two questions each, some with a system prompt; deterministic, built at run time with no download."""
    conversations = []
    for document in load_pydocs_documents(split):
        pairs = _qa_pairs(document)
        for i in range(0, len(pairs), 2):
            turn = pairs[i:i + 2]
            key = int(hashlib.sha256(turn[0][0].encode()).hexdigest()[:8], 16)
            messages = [{"role": "system", "content": _SYSTEM}] if key % 3 == 0 else []
            for j, (name, answer) in enumerate(turn if key % 2 == 0 else turn[:1]):
                messages.append({"role": "user", "content": _QUESTIONS[(key + j) % len(_QUESTIONS)].format(name=name)})
                messages.append({"role": "assistant", "content": answer})
            conversations.append(messages)
    if not conversations:
        logger.warning(f"pydocs_chat {split}: this Python's standard library gave no documented definitions")
    return conversations
