"""Chat templates: render a conversation to text and find which of its tokens the assistant wrote.

Supervised fine-tuning trains only on the assistant's tokens, so a conversation must become token ids
plus a 0/1 mask. Models published on the Hugging Face Hub describe their chat format as a Jinja
template (``chat_template`` in tokenizer_config.json) written for ``transformers``'
``apply_chat_template``; a template renders correctly only in the environment it was written for.
This module therefore renders the way transformers does (same Jinja options, tag, filter and globals,
so the same text and ids), and builds the assistant mask the way its ``return_assistant_tokens_mask``
does, so data prepared here matches what the model's own tooling produces.

The mask comes from ``{% generation %}...{% endgeneration %}`` blocks when the template has them: each
records the character span of the text it renders. Templates without them (most on the Hub) get, for each
assistant message, the text the model writes after the generation prompt: the reasoning block the template
renders for it (if any), its content and the end of turn. Where renders of the conversation's prefixes nest,
they give it (_prefix_spans); where they do not, it is located in the whole conversation's rendering
(_located_spans).

Our shipped tokenizer's template (assets/tokenizer/tokenizer_config.json holds it as one line) is
DEFAULT_CHAT_TEMPLATE below; laid out for reading (this layout's whitespace is not part of it)::

    {{ bos_token }}
    {% for message in messages %}
        {% if message['role'] not in ['system', 'user', 'assistant'] %}
            {{ raise_exception("unknown chat role '" ~ message['role'] ~ "': expected system, user or assistant") }}
        {% endif %}
        {{ '<|' ~ message['role'] ~ '|>\\n' }}
        {% if message['role'] == 'assistant' %}
            {% generation %}{{ message['content'] ~ eos_token }}{% endgeneration %}
        {% else %}
            {{ message['content'] ~ eos_token }}
        {% endif %}
    {% endfor %}
    {% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}

so "hi" answered by "hello" renders as (with \\n a newline)::

    <|begin_of_text|><|user|>\\nhi<|end_of_text|><|assistant|>\\nhello<|end_of_text|>

The role headers are plain text (the vocabulary has no tokens for them, and it stays unchanged); the
EOS ending each turn is the special token. An assistant turn's EOS is inside its generation block, so
the model learns to stop, even after an empty reply.
"""

from __future__ import annotations

import bisect
import contextvars
import functools
import json
import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from torchtitan.data.tokenizer import Tokenizer

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception(\"unknown chat role '\" ~ message['role'] ~ \"': expected system, user or assistant\") }}"
    "{% endif %}{{ '<|' ~ message['role'] ~ '|>\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] ~ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] ~ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

Messages = Sequence[dict[str, Any]]


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, or gave no usable assistant spans (one-line message)."""


def _one_line(text: str) -> str:
    # Jinja's messages can span lines (source excerpts); callers prefix a row number and log one line.
    return " | ".join(line.strip() for line in str(text).splitlines() if line.strip())


# The render in progress on this thread/task: [characters yielded so far, generation spans]. A context
# variable rather than state on the environment, so that concurrent renders cannot mix their spans.
_TRACKER: contextvars.ContextVar[list | None] = contextvars.ContextVar("chat_template_tracker", default=None)


class _GenerationExtension(jinja2.ext.Extension):
    """The ``{% generation %}...{% endgeneration %}`` tag: renders its body and records its character span.

    The span starts at the number of characters the template had yielded when the block ran, as in
    transformers (which makes a block inside a macro or ``{% set %}`` report a position relative to the
    top-level output, not the macro's; matching that keeps our spans equal to its spans).
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

    def _generation(self, caller: Any) -> str:
        text = caller()
        tracker = _TRACKER.get()
        if tracker is not None:
            tracker[1].append((tracker[0], tracker[0] + len(text)))
        return text


def _raise_exception(message: str) -> None:
    # Templates call this to refuse input (an unknown role, a misplaced system message).
    raise ChatTemplateError(f"chat template refused the conversation: {_one_line(message)}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers replaces Jinja's tojson (which HTML-escapes <, >, & and ') with plain json.dumps,
    # keeping non-ASCII as is; templates render tool schemas with it, so the output must match.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    # Templates that state today's date in the system prompt use this.
    return datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    # Templates come with downloaded models: the sandbox stops them reaching Python internals, and
    # immutability stops them mutating the messages they are given. The options are transformers'.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationExtension, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# The names a message's reasoning goes by, in the order transformers (5.x) picks the one that counts.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    """The message with its reasoning also under ``reasoning_content`` and ``thinking``, as transformers
    passes it: templates read one name or the other (Qwen3 and GLM ``reasoning_content``, gpt-oss
    ``thinking``) whichever the data used. The first of REASONING_KEYS that is set wins and overwrites
    ``reasoning_content``; a ``thinking`` the message has is kept. ``thinking`` comes first, as there (a
    template may list the message's keys)."""
    reasoning = next((message[key] for key in REASONING_KEYS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    aliased = {"thinking": reasoning}
    aliased.update(message)
    aliased["reasoning_content"] = reasoning
    return aliased


class ChatTemplate:
    """A compiled chat template (Jinja source, e.g. a tokenizer_config.json's ``chat_template``)."""

    def __init__(self, source: str):
        self.source = source
        env = _environment()
        try:
            ast = env.parse(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {_one_line(e.message)}") from None
        # Found in the parsed template, not by searching the text, so a comment mentioning the tag is ignored.
        self.has_generation_markers = any(
            node.name == "_generation" for node in ast.find_all(jinja2.nodes.ExtensionAttribute)
        )
        try:
            self._template = env.from_string(ast)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {_one_line(e)}") from None

    def __getstate__(self) -> dict:
        # Compiled templates do not pickle; dataloader workers recompile from the source.
        return {"source": self.source}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["source"])

    def render(self, messages: Messages, add_generation_prompt: bool = False, **extra: Any
               ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its generation blocks, in order.

        extra holds further template variables, e.g. bos_token and eos_token. Like transformers,
        ``tools`` and ``documents`` default to None, message keys whose value is None are dropped
        (templates test ``'content' in message`` or ``message.content is defined``) and a message's
        reasoning is given under the names templates read (see _alias_reasoning).
        """
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ChatTemplateError(f"message {i} is a {type(message).__name__}, not a dict of role and content")
        messages = [_alias_reasoning({key: value for key, value in message.items() if value is not None})
                    for message in messages]
        variables = {"tools": None, "documents": None, **extra}
        tracker = [0, []]
        token = _TRACKER.set(tracker)
        pieces = []
        try:
            # generate() yields the output piece by piece, so tracker[0] is the text length so far
            # whenever a generation block runs.
            for piece in self._template.generate(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            ):
                pieces.append(piece)
                tracker[0] += len(piece)
        except ChatTemplateError:
            raise
        except Exception as e:  # a template is code: any error in it is the template's (or the data's) fault
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {_one_line(e)}") from None
        finally:
            _TRACKER.reset(token)
        return "".join(pieces), tracker[1]


def _mark_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """0/1 per token: 1 where the token's characters overlap a span, the rule of transformers'
    ``return_assistant_tokens_mask`` (5.x), so masks agree token for token.

    A character the tokenizer splits into several byte tokens gives each of them its whole offsets, so all
    of them are marked and the model learns to finish the character. Tokens and spans are walked together
    in order, as transformers does: a span is left behind once a token starts at or after its end, and a
    token is tested against the first span not left behind only.
    """
    mask = [0] * len(offsets)
    remaining = iter(spans)
    span = next(remaining, None)
    for index, (start, end) in enumerate(offsets):
        while span is not None and start >= span[1]:
            span = next(remaining, None)
        if span is None:
            break
        mask[index] = int(end > span[0])
    return mask


def _template_variables(tokenizer: Tokenizer) -> dict[str, str]:
    # transformers passes the tokenizer's special_tokens_map, which omits unset tokens.
    names = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token}
    return {name: token for name, token in names.items() if token is not None}


@functools.lru_cache(maxsize=16)
def _end_of_turn_pattern(special_tokens: frozenset[str]) -> re.Pattern | None:
    # One search for all special tokens; the longest first, so that where two start at one place the longer wins.
    if not special_tokens:
        return None
    return re.compile("|".join(re.escape(token) for token in sorted(special_tokens, key=len, reverse=True)))


def _end_of_turn_length(after: str, special_tokens: frozenset[str]) -> int:
    """How much of the template text after an assistant content is trained: through its first special
    token (the end of turn, e.g. <|im_end|>, after any tool calls the template writes), else none."""
    pattern = _end_of_turn_pattern(special_tokens)
    found = pattern.search(after) if pattern is not None else None
    return 0 if found is None else found.end()


def _has_text(message: dict) -> bool:
    # Assistant contents that a marker stands in for. Not an empty one: templates test content for truth
    # (Qwen2.5 and Qwen3 write a newline before tool calls only after content), so a marker renders differently.
    return message.get("role") == "assistant" and isinstance(message.get("content"), str) and message["content"] != ""


# Stands in for an assistant's content in the marked renders (see _prefix_spans, _located_spans). Capital
# letters and digits only, so that what templates do to content (strip it, split it at a tag, test its
# prefix) leaves it whole.
_FIELD_MARKER = "TTCHATFIELD7F3A9C"
_MARKER_PATTERN = re.compile(_FIELD_MARKER + r"M(\d+)Z")


def _with_marker(message: dict, i: int) -> dict:
    return {**message, "content": f"{_FIELD_MARKER}M{i}Z"}


def _prefix_spans(template: ChatTemplate, messages: Messages, text: str, variables: dict,
                  special_tokens: frozenset[str]) -> list[tuple[int, int]] | None:
    """Assistant spans from renders of the conversation's prefixes; None where those do not nest.

    The conversation up to an assistant message, rendered with the generation prompt, is what the model
    sees before it writes that message; rendering one message more appends its turn. That holds when each
    render is a prefix of the next and of ``text`` (the whole conversation's), which is checked; templates
    that render an earlier turn differently once the conversation goes on (Qwen3 drops old reasoning) fail
    it and are located instead (_located_spans). Nothing is matched, so this takes a turn however the
    template writes it: reasoning taken out of the content, tool calls, list-of-parts content.

    A turn is trained from the prompt's end (a reasoning block written there included) through its content
    and the end of turn after it (see _end_of_turn_length), as _located_spans trains it: where the content
    ends comes from rendering the prefix once more with the content replaced by a marker. A turn without
    text content is trained through its first special token; one that cannot be cut so, whole.
    """
    turns = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        try:  # a template may refuse a prefix (e.g. one without a user message yet): then locate instead
            before, _ = template.render(messages[:i], add_generation_prompt=True, **variables)
            through, _ = template.render(messages[:i + 1], **variables)
        except ChatTemplateError:
            return None
        if not (through.startswith(before) and text.startswith(through)):
            return None
        if len(through) > len(before):
            turns.append((i, len(before), len(through)))
    spans = []
    for i, start, end in turns:
        turn = text[start:end]
        trained = len(turn)
        if _has_text(messages[i]):
            marker = _with_marker(messages[i], i)
            try:
                marked, _ = template.render([*messages[:i], marker], **variables)
            except ChatTemplateError:
                marked = ""
            at = marked.rfind(marker["content"])
            after = marked[at + len(marker["content"]):]
            # The text after the content must end the real turn too (it may not where the template tests the
            # content itself); if not, the whole turn is trained.
            if at >= 0 and len(after) <= len(turn) and turn.endswith(after):
                trained = len(turn) - len(after) + _end_of_turn_length(after, special_tokens)
        else:
            trained = _end_of_turn_length(turn, special_tokens) or trained
        spans.append((start, start + trained))
    return spans


# Candidate readings of the real rendering that _place_contents tests before a conversation is refused:
# real conversations need one per content, a content holding the template's own text a few more.
_PLACEMENT_TRIES_BASE = 1_000
_PLACEMENT_TRIES_PER_CONTENT = 16


def _place_contents(text: str, pieces: list[str], values: list[str]) -> list[tuple[int, int]] | None:
    """The (start, end) in ``text`` of each content, given the locating render cut at its markers.

    ``text`` must read pieces[0], values[0] as rendered, pieces[1], ..., pieces[-1] (one piece more than
    values). A content's rendering is taken to be a substring of it (templates strip or cut content; they
    do not rewrite it). Where that allows several readings (a content holding the template's own text), the
    longest rendering is tried first and the next on a dead end. None if there is no reading, or none within
    the tries budgeted (each costs up to a content's length), which keeps a row that ends up refused cheap.
    """
    if not values:
        return [] if text == pieces[0] else None
    tries = _PLACEMENT_TRIES_BASE + _PLACEMENT_TRIES_PER_CONTENT * len(values)

    def ends(k: int, start: int):
        # Where content k can end, longest rendering first: where its piece follows, and for the last content
        # where nothing else does. Usually the first found is the content itself (a find, no character loop).
        nonlocal tries
        value, piece = values[k], pieces[k + 1]
        last = len(text) - len(piece)
        high = min(start + len(value), last)
        low = last if k == len(values) - 1 else start
        while high >= low and tries > 0:
            end = text.rfind(piece, low, high + len(piece))
            if end < 0:
                return
            tries -= 1
            if text[start:end] in value:
                yield end
            high = end - 1

    if not text.startswith(pieces[0]):
        return None
    chosen: list[tuple[int, int]] = []
    options = [ends(0, len(pieces[0]))]
    while options and tries > 0:
        k = len(options) - 1
        end = next(options[k], None)
        if end is None:  # a dead end: take back the choice that led here
            options.pop()
            if chosen:
                chosen.pop()
            continue
        start = len(pieces[0]) if k == 0 else chosen[-1][1] + len(pieces[k])
        chosen.append((start, end))
        if k + 1 == len(values):
            return chosen
        options.append(ends(k + 1, end + len(pieces[k + 1])))
    return None


def _aligned_end(prompt: str, located: str, markers: list[re.Match], previous: int) -> int | None:
    """Where ``prompt`` (the conversation before an assistant turn, rendered on its own) ends in the locating
    render: it must read like it from the marker before the turn (markers[previous], or the start) on. None
    where it does not (what precedes the turn is rendered differently once the conversation goes on)."""
    begin, tail = 0, prompt
    if previous >= 0:  # align on the previous marker: what comes before it may be rendered differently in a prefix
        same = [m for m in _MARKER_PATTERN.finditer(prompt) if m.group(0) == markers[previous].group(0)]
        if len(same) != 1:
            return None
        begin, tail = markers[previous].end(), prompt[same[0].end():]
    return begin + len(tail) if located.startswith(tail, begin) else None


def _located_spans(template: ChatTemplate, messages: Messages, text: str, add_generation_prompt: bool,
                   variables: dict, special_tokens: frozenset[str]) -> list[tuple[int, int]]:
    """Assistant spans of a template without generation blocks, found in the conversation's own rendering.

    The conversation is rendered once more with each assistant's text content replaced by a marker (the
    locating render); the markers show where each content sits, and the template's text around them (the
    other messages' contents included, verbatim) is matched onto ``text``, the real rendering. An assistant
    message's span runs from the end of the generation prompt before it (see _aligned_end), so it takes the
    reasoning block the template renders for it, through its content and the end of turn after it (see
    _end_of_turn_length). A message with empty or no text content has no marker: its span runs from the
    prompt's end through the first special token before the next marker. Only the whole conversation and
    the parts before each assistant turn are rendered, so templates that render earlier turns differently
    once the conversation goes on (Qwen3 drops old reasoning, Phi-3 ends with EOS unless prompted) are
    located like any other.
    """
    if _FIELD_MARKER in text:
        raise ChatTemplateError(f"cannot locate the assistant's text: the conversation contains {_FIELD_MARKER!r}, "
                                "the marker used to find it")
    marked = [_with_marker(message, i) if _has_text(message) else message for i, message in enumerate(messages)]
    located, _ = template.render(marked, add_generation_prompt, **variables)
    markers = list(_MARKER_PATTERN.finditer(located))
    owners = [int(m.group(1)) for m in markers]
    cuts = [0] + [point for m in markers for point in (m.start(), m.end())] + [len(located)]
    pieces = [located[a:b] for a, b in zip(cuts[::2], cuts[1::2])]
    places = _place_contents(text, pieces, [messages[owner]["content"] for owner in owners])
    if places is None:
        raise ChatTemplateError(
            "cannot locate the assistant's text: the chat template (no {% generation %} blocks) renders this "
            "conversation differently once the assistant's contents are replaced by markers, or rewrites a "
            "content (e.g. reasoning written inside a content that the template moves out of it in a multi-turn "
            "conversation; give it as reasoning_content)")
    marker_ends = [m.end() for m in markers]

    def in_text(position: int) -> int:
        # Template text keeps its place relative to the content before it.
        k = bisect.bisect_right(marker_ends, position) - 1
        return position if k < 0 else places[k][1] + position - marker_ends[k]

    has_prompt = None  # whether the template writes a generation prompt: asked at the first assistant turn only

    def prompt_end(i: int, previous: int) -> int | None:
        # Where the model takes over before message i: the end of the conversation before it, rendered with the
        # generation prompt (the same text without one where the template has none).
        nonlocal has_prompt
        try:
            prompt, _ = template.render(marked[:i], add_generation_prompt=True, **variables)
            if has_prompt is None:
                has_prompt = prompt != template.render(marked[:i], add_generation_prompt=False, **variables)[0]
        except ChatTemplateError:
            return None
        return _aligned_end(prompt, located, markers, previous)

    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if _has_text(message):
            mine = [k for k, owner in enumerate(owners) if owner == i]
            if len(mine) != 1:
                raise ChatTemplateError(f"message {i} (assistant): cannot locate its text: the chat template "
                                        f"renders its content {len(mine)} times and has no {{% generation %}} "
                                        "blocks to mark it")
            k = mine[0]
            start = prompt_end(i, k - 1)
            # No prompt: a header cannot be told from the text before it, so the content starts the span.
            if start is None or not has_prompt or start > markers[k].start():
                start = markers[k].start()
            after_end = markers[k + 1].start() if k + 1 < len(markers) else len(located)
            end = markers[k].end() + _end_of_turn_length(located[markers[k].end():after_end], special_tokens)
        else:
            previous = sum(owner < i for owner in owners) - 1
            limit = markers[previous + 1].start() if previous + 1 < len(markers) else len(located)
            start = prompt_end(i, previous)
            if start is None or any(owner >= i for owner in owners[:previous + 1]) or start > limit:
                raise ChatTemplateError(f"message {i} (assistant): cannot locate its turn: it has no text content, "
                                        "and the conversation before it renders differently on its own")
            length = _end_of_turn_length(located[start:limit], special_tokens)
            if length == 0:
                raise ChatTemplateError(f"message {i} (assistant): cannot locate its turn: it has no text content, "
                                        "and no special token ends its turn")
            end = start + length
        spans.append((in_text(start), in_text(end)))
    return sorted(spans)


def chat_ids(tokenizer: Tokenizer, template: ChatTemplate, messages: Messages,
             add_generation_prompt: bool = False) -> list[int]:
    """Token ids of the rendered conversation (a prompt, with add_generation_prompt), with no mask."""
    text, _ = template.render(messages, add_generation_prompt=add_generation_prompt, **_template_variables(tokenizer))
    return tokenizer.encode_chat(text)[0]


def assistant_token_mask(tokenizer: Tokenizer, template: ChatTemplate, messages: Messages,
                         add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask that is 1 on the assistant's tokens.

    With generation blocks the mask equals transformers' ``apply_chat_template(...,
    return_assistant_tokens_mask=True)``. Without them each assistant message's span comes from prefix
    renders, or where those do not nest is located in the rendering itself (see _prefix_spans,
    _located_spans), and the mask equals transformers' for the same template with generation blocks written
    around those spans. Training data leaves add_generation_prompt off; it is
    for prompts that end where the model takes over.
    """
    variables = _template_variables(tokenizer)
    text, spans = template.render(messages, add_generation_prompt=add_generation_prompt, **variables)
    if not template.has_generation_markers:
        special_tokens = tokenizer.special_tokens
        spans = _prefix_spans(template, messages, text, variables, special_tokens)
        if spans is None:
            spans = _located_spans(template, messages, text, add_generation_prompt, variables, special_tokens)
    ids, offsets = tokenizer.encode_chat(text)
    return ids, _mark_spans(offsets, spans)
