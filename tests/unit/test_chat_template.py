"""Chat templates: rendering and assistant masks agree with transformers' apply_chat_template."""

import pickle
import random
import shutil

import pytest

from tests.conftest import TOKENIZER
from torchtitan.data import build_tokenizer
from torchtitan.data.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    assistant_token_mask,
)

# A ChatML-like layout without generation blocks: masks come from prefix renders.
PLAIN_TEMPLATE = (
    r"{{ bos_token }}{% for message in messages %}"
    r"{{ '<|im_start|>' ~ message['role'] ~ '\n' ~ message['content'] ~ eos_token ~ '\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The same layout with generation blocks around exactly what the prefix renders attribute to the assistant.
MARKED_TEMPLATE = (
    r"{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' ~ message['role'] ~ '\n' }}"
    r"{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] ~ eos_token ~ '\n' }}"
    r"{% endgeneration %}{% else %}{{ message['content'] ~ eos_token ~ '\n' }}{% endif %}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Content pieces: words, whitespace runs and newlines (which merge with the header's newline into one
# token), multi-byte and combining characters, special-token and Jinja-looking strings.
PIECES = ["Hello", " world", "ing", "'s", " 123", ".", "!", " ", "  ", "\n", "\n\n", "\t", "é", "世界", "🙂",
          "👩\u200d💻", "e\u0301", "<|end_of_text|>", "<|user|>", "{{ x }}", "ok"]


def random_conversations(count: int = 20, seed: int = 1234) -> list[tuple[list[dict], bool]]:
    """(messages, add_generation_prompt): system prompts, multi-turn, repeated roles, empty contents."""
    rng = random.Random(seed)

    def content():
        return "" if rng.random() < 0.15 else "".join(rng.choices(PIECES, k=rng.randrange(1, 12)))

    conversations = []
    for _ in range(count):
        roles = ["system"] if rng.random() < 0.5 else []
        for _ in range(rng.randrange(1, 5)):
            roles += ["user", "assistant"] + (["assistant"] if rng.random() < 0.15 else [])
        if rng.random() < 0.3:
            roles.pop()  # ends with a user turn: the prompt for the next reply
        messages = [{"role": role, "content": content()} for role in roles]
        conversations.append((messages, roles[-1] != "assistant" and rng.random() < 0.7))
    return conversations


CONVERSATIONS = random_conversations()


@pytest.fixture(scope="module")
def hf_reference():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)


@pytest.fixture(scope="module")
def tokenizers():
    return {name: build_tokenizer(str(TOKENIZER), name) for name in ("tokenizer.json", "tokenizer.model")}


def test_shipped_template_matches_transformers(hf_reference, tokenizers):
    tokenizer = tokenizers["tokenizer.json"]
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE == hf_reference.chat_template
    template = ChatTemplate(tokenizer.chat_template)
    assert template.has_generation_markers
    all_masks = []
    for messages, add_generation_prompt in CONVERSATIONS:
        expected = hf_reference.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True,
            return_assistant_tokens_mask=True, return_dict=True,
        )
        ids, mask = assistant_token_mask(tokenizer, template, messages, add_generation_prompt=add_generation_prompt)
        assert ids == list(expected["input_ids"]), messages
        assert mask == list(expected["assistant_masks"]), messages
        text, _ = template.render(messages, add_generation_prompt, bos_token="<|begin_of_text|>",
                                  eos_token="<|end_of_text|>")
        assert text == hf_reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                        tokenize=False)
        # One BOS; every turn ends with the EOS, and each assistant turn's EOS is trained.
        assert ids[0] == tokenizer.bos_id and ids.count(tokenizer.bos_id) == 1 + text.count("<|begin_of_text|>", 1)
        eos_positions = [i for i, t in enumerate(ids) if t == tokenizer.eos_id]
        assert len(eos_positions) == len(messages) + sum(m["content"].count("<|end_of_text|>") for m in messages)
        all_masks += mask
    assert 0 < sum(all_masks) < len(all_masks)


def test_shipped_template_layout(tokenizers):
    tokenizer = tokenizers["tokenizer.json"]
    template = ChatTemplate(tokenizer.chat_template)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    text, spans = template.render(messages, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    assert text == "<|begin_of_text|><|user|>\nhi<|end_of_text|><|assistant|>\n<|end_of_text|>"
    assert [text[s:e] for s, e in spans] == ["<|end_of_text|>"]
    ids, mask = assistant_token_mask(tokenizer, template, messages)
    assert [i for i, m in zip(ids, mask) if m] == [tokenizer.eos_id]  # an empty reply still learns to stop
    prompt, _ = template.render(messages[:1], add_generation_prompt=True, bos_token=tokenizer.bos_token,
                                eos_token=tokenizer.eos_token)
    assert prompt == "<|begin_of_text|><|user|>\nhi<|end_of_text|><|assistant|>\n"


def runs(ids, mask, tokenizer):
    """Decoded text of each maximal run of masked tokens."""
    found, current = [], []
    for token, masked in zip(ids + [None], mask + [0]):
        if masked:
            current.append(token)
        elif current:
            found.append(tokenizer.decode(current))
            current = []
    return found


def test_template_without_markers_masks_from_prefix_renders(hf_reference, tokenizers):
    tokenizer = tokenizers["tokenizer.json"]
    plain, marked = ChatTemplate(PLAIN_TEMPLATE), ChatTemplate(MARKED_TEMPLATE)
    assert not plain.has_generation_markers and marked.has_generation_markers
    for messages, add_generation_prompt in CONVERSATIONS:
        expected = hf_reference.apply_chat_template(
            messages, chat_template=PLAIN_TEMPLATE, add_generation_prompt=add_generation_prompt, tokenize=True,
            return_dict=True,
        )
        ids, mask = assistant_token_mask(tokenizer, plain, messages, add_generation_prompt=add_generation_prompt)
        assert ids == list(expected["input_ids"]), messages
        # Prefix renders find exactly what generation blocks around the same text mark.
        assert (ids, mask) == assistant_token_mask(tokenizer, marked, messages, add_generation_prompt), messages

    eos = "<|end_of_text|>"
    by_hand = [
        ([{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It is 4."}],
         [f"It is 4.{eos}\n"]),
        ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Bye"},
          {"role": "assistant", "content": "Goodbye"}],
         [f"Hello there{eos}\n", f"Goodbye{eos}\n"]),
        ([{"role": "user", "content": "Translate: cat"}, {"role": "assistant", "content": "Katze – chat – 猫 🐱"},
          {"role": "user", "content": "Thanks"}],
         [f"Katze – chat – 猫 🐱{eos}\n"]),
    ]
    for messages, assistant_texts in by_hand:
        ids, mask = assistant_token_mask(tokenizer, plain, messages)
        assert runs(ids, mask, tokenizer) == assistant_texts
        expected = hf_reference.apply_chat_template(messages, chat_template=PLAIN_TEMPLATE, tokenize=True)
        assert ids == list(expected["input_ids"])


def test_tiktoken_path_matches_hf_path(tokenizers):
    hf, fast = tokenizers["tokenizer.json"], tokenizers["tokenizer.model"]
    assert fast.chat_template == hf.chat_template == DEFAULT_CHAT_TEMPLATE
    extra = ["a\u0301\u0301 👩\u200d💻 \U0001f600x é" * 3, "", "<|pad|><|end_of_text|>𝔘𝔫𝔦"]
    for source in (DEFAULT_CHAT_TEMPLATE, PLAIN_TEMPLATE):
        template = ChatTemplate(source)
        for messages, add_generation_prompt in CONVERSATIONS:
            text, _ = template.render(messages, add_generation_prompt, bos_token=hf.bos_token, eos_token=hf.eos_token)
            assert fast.encode_chat(text) == hf.encode_chat(text)  # ids and offsets
            assert assistant_token_mask(fast, template, messages, add_generation_prompt) == assistant_token_mask(
                hf, template, messages, add_generation_prompt)
    for text in extra:
        assert fast.encode_chat(text) == hf.encode_chat(text)
        offsets = fast.encode_chat(text)[1]
        assert (offsets[-1][1] if offsets else 0) == len(text)


def test_encode_chat_keeps_encode_unchanged(tokenizers):
    for tokenizer in tokenizers.values():
        text = "a<|end_of_text|>b"
        ids, offsets = tokenizer.encode_chat(text)
        assert ids[1] == tokenizer.eos_id and offsets[1] == (1, 16)
        assert tokenizer.eos_id not in tokenizer.encode(text)  # plain encode still treats it as text
        copy = pickle.loads(pickle.dumps(tokenizer))
        assert copy.encode_chat(text) == (ids, offsets) and copy.encode(text) == tokenizer.encode(text)


def test_chat_template_is_none_without_the_config_key(tmp_path):
    shutil.copy(TOKENIZER / "tokenizer.json", tmp_path / "tokenizer.json")
    assert build_tokenizer(str(tmp_path)).chat_template is None


def test_jinja_environment_matches_transformers(hf_reference):
    # tojson's defaults and options, loop controls, strftime_now, dropped None values, extra variables.
    source = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson }}|"
        "{{ m | tojson(indent=2, sort_keys=true) }}|{{ m | tojson(separators=(',', ':')) }}\n{% endfor %}"
        "{{ strftime_now('%Y') }} {{ tools is none }} {{ custom }} {{ eos_token }}"
    )
    messages = [{"role": "user", "content": "<é> & 'x' 🙂", "name": None}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    text, spans = ChatTemplate(source).render(messages, custom="extra", eos_token="<|end_of_text|>")
    assert spans == []
    assert text == hf_reference.apply_chat_template(messages, chat_template=source, tokenize=False, custom="extra")
    assert '"<é> & \'x\' 🙂"' in text and "name" not in text
    template = pickle.loads(pickle.dumps(ChatTemplate(source)))
    assert template.render(messages, custom="extra", eos_token="<|end_of_text|>") == (text, [])


def test_errors_are_one_line_chat_template_errors(tokenizers):
    tokenizer = tokenizers["tokenizer.json"]
    shipped = ChatTemplate(DEFAULT_CHAT_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="unknown chat role 'tool'"):
        assistant_token_mask(tokenizer, shipped, [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}])
    with pytest.raises(ChatTemplateError, match="syntax error at line 2") as error:
        ChatTemplate("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    assert "\n" not in str(error.value)
    with pytest.raises(ChatTemplateError, match="failed to render: .*not_a_function") as error:
        ChatTemplate("{{ not_a_function() }}").render([])
    assert "\n" not in str(error.value)
    # Ends differently when the conversation goes on, so the render through message 1 is no prefix.
    trailing = ("{% for m in messages %}{{ m['role'] ~ ': ' ~ m['content'] ~ '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% else %}END{% endif %}")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}]
    with pytest.raises(ChatTemplateError, match="message 1 ") as error:
        assistant_token_mask(tokenizer, ChatTemplate(trailing), messages)
    assert "\n" not in str(error.value)
    ids, mask = assistant_token_mask(tokenizer, ChatTemplate(trailing), messages[:2])  # the last turn is fine
    assert runs(ids, mask, tokenizer) == [" b\nEND"]  # the token " b" straddles the span's start: it is marked
