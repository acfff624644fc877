"""Chat templates: render a conversation to text and find which of its tokens the assistant wrote.

Supervised fine-tuning trains only on the assistant's tokens, so a conversation must become token ids
plus a 0/1 mask. Models published on the Hugging Face Hub describe their chat format as a Jinja
template (``chat_template`` in tokenizer_config.json) written for ``transformers``'
``apply_chat_template``; a template renders correctly only in the environment it was written for.
This module therefore renders the way transformers does (same Jinja options, tag, filter and globals,
so the same text and ids), and builds the assistant mask the way its ``return_assistant_tokens_mask``
does, so data prepared here matches what the model's own tooling produces.

The mask comes from ``{% generation %}...{% endgeneration %}`` blocks when the template has them: each
records the character span of the text it renders. Templates without them (most on the Hub) get spans
from rendering prefixes of the conversation instead (see assistant_token_mask).

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

import contextvars
import json
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
        ``tools`` and ``documents`` default to None and message keys whose value is None are dropped
        (templates test ``'content' in message`` or ``message.content is defined``).
        """
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ChatTemplateError(f"message {i} is a {type(message).__name__}, not a dict of role and content")
        messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
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


def _char_to_token(offsets: Sequence[tuple[int, int]]) -> dict[int, int]:
    # The first token whose offsets contain each character: Hugging Face's Encoding.char_to_token.
    # Characters no token covers are absent.
    first: dict[int, int] = {}
    for index, (start, end) in enumerate(offsets):
        for char in range(start, end):
            first.setdefault(char, index)
    return first


def _mark_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """0/1 per token: 1 from the token of each span's first character through that of its last.

    The rule of transformers' return_assistant_tokens_mask, quirks included so masks agree: a span
    whose first character has no token stops the marking of it and of all later spans; a last
    character with no token (or in token 0) marks through the end; an empty span (s, s) looks up
    characters s and s - 1, so it usually marks nothing (at s = 0 transformers fails; here it marks nothing).
    """
    char_to_token = _char_to_token(offsets)
    mask = [0] * len(offsets)
    for start_char, end_char in spans:
        if end_char == 0:
            continue
        start_token = char_to_token.get(start_char)
        end_token = char_to_token.get(end_char - 1)
        if start_token is None:
            break
        for index in range(start_token, end_token + 1 if end_token else len(mask)):
            mask[index] = 1
    return mask


def _template_variables(tokenizer: Tokenizer) -> dict[str, str]:
    # transformers passes the tokenizer's special_tokens_map, which omits unset tokens.
    names = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token}
    return {name: token for name, token in names.items() if token is not None}


def _prefix_spans(template: ChatTemplate, messages: Messages, text: str, variables: dict) -> list[tuple[int, int]]:
    """Assistant spans of a template without generation blocks, from renders of conversation prefixes.

    The conversation up to an assistant message, rendered with the generation prompt, is what the
    model sees before it writes that message; rendering one message more appends what it wrote. That
    holds only if each render is a prefix of the next and of the whole conversation's text, so it is
    checked (templates that rewrite earlier turns, e.g. drop old reasoning, fail it).
    """
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, _ = template.render(messages[:i], add_generation_prompt=True, **variables)
        through, _ = template.render(messages[: i + 1], **variables)
        if not through.startswith(before) or not text.startswith(through):
            raise ChatTemplateError(
                f"message {i} (assistant): cannot locate its text: the chat template has no {{% generation %}} "
                "blocks, and its rendering of the messages before this one (with the generation prompt) is not "
                "a prefix of its rendering through this one, or that is not a prefix of the whole conversation's"
            )
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    return spans


def assistant_token_mask(tokenizer: Tokenizer, template: ChatTemplate, messages: Messages,
                         add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 mask that is 1 on the assistant's tokens.

    With generation blocks the mask equals transformers' ``apply_chat_template(...,
    return_assistant_tokens_mask=True)``. Without them each assistant message's span comes from
    prefix renders (see _prefix_spans); a token straddling a span's edge is marked. Training data
    leaves add_generation_prompt off; it is for prompts that end where the model takes over.
    """
    variables = _template_variables(tokenizer)
    text, spans = template.render(messages, add_generation_prompt=add_generation_prompt, **variables)
    if not template.has_generation_markers:
        spans = _prefix_spans(template, messages, text, variables)
    ids, offsets = tokenizer.encode_chat(text)
    return ids, _mark_spans(offsets, spans)
