// Built-in ChatML renderer (docs/design.md "Chat rendering"): mode qwen3 reproduces the Qwen3
// tokenizer_config.json Jinja template exactly (tools excluded); mode qwen3.8 follows docs/model.md
// A.5. Called by apps/ (fngen tokenize/generate --chat). encode_chat() recognises only the
// template's own special tokens; message text is encoded in Plain mode, so it cannot forge them.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace fn {

/// One chat turn. role: "system", "user", "assistant" or "tool" (others: fn::Error Usage).
struct ChatMessage {
  std::string role;
  std::string content;
  std::optional<std::string> reasoning_content;  ///< assistant thinking; nullopt = not given
};

/// The "messages" of an OpenAI-style chat request (a JSONL record of fngen generate -i or
/// tokenize -i): a non-empty JSON array of {"role", "content", "reasoning_content"?} objects with
/// string fields and role system|user|assistant|tool. Throws fn::Error(Format) naming the first
/// bad element, e.g. "\"messages\"[2].role must be a string".
std::vector<ChatMessage> chat_messages_from_json(const nlohmann::json& messages);

/// The fields of the entries of `messages` that chat_messages_from_json does not read (any but
/// role, content and reasoning_content), for callers to warn about as they warn about a record's
/// unknown fields: each name once, with the index of the first entry holding it, in entry order
/// (and by name within an entry). Entries that are not objects are skipped; not a list: none.
std::vector<std::pair<std::string, std::size_t>> unknown_chat_message_fields(
    const nlohmann::json& messages);

enum class ChatMode {
  Qwen3,   ///< the Qwen3 tokenizer_config.json template, exactly
  Qwen38,  ///< docs/model.md A.5: thinking kept for every assistant turn (preserve_thinking)
};

/// Parses "qwen3" | "qwen3.8"; throws fn::Error(Usage) naming the value otherwise.
ChatMode parse_chat_mode(std::string_view name);

struct ChatOptions {
  ChatMode mode = ChatMode::Qwen38;
  bool add_generation_prompt = true;
  /// nullopt = the template's default (thinking on). Qwen3 emits "<think>\n\n</think>\n\n" after
  /// the generation prompt only when false; Qwen3.8 emits "<think>\n" when on, that block when off.
  std::optional<bool> enable_thinking;
};

/// A piece of rendered text: a special token the template itself wrote, or ordinary text
/// (template literals and message content).
struct ChatSegment {
  std::string text;
  bool special = false;
};

/// Renders messages into segments (concatenated: the template's text).
std::vector<ChatSegment> render_chat_segments(std::span<const ChatMessage> messages,
                                              const ChatOptions& options);

/// Renders messages to the template's text.
std::string render_chat(std::span<const ChatMessage> messages, const ChatOptions& options);

/// Renders and encodes: template special tokens by id, all other text with EncodeMode::Plain.
/// Throws fn::Error(Format) when the tokenizer lacks one of the template's tokens.
std::vector<int32_t> encode_chat(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                 const ChatOptions& options);

/// Generated assistant text split at the first "</think>": reasoning before it (a leading
/// "<think>" and surrounding newlines removed), content after it (leading newlines removed).
/// Without "</think>" all text is content.
struct ReasoningSplit {
  std::string reasoning;
  std::string content;
  bool has_reasoning = false;
};
ReasoningSplit split_reasoning(std::string_view generated);

}  // namespace fn
