// ChatML rendering: the Qwen3 Jinja template transcribed statement by statement (comments quote
// it), and the Qwen3.8 variant of docs/model.md A.5.
#include "tokenizer/chat.h"

#include <nlohmann/json.hpp>
#include <unordered_set>

#include "core/error.h"

namespace fn {
namespace {

// The template's special tokens (ids resolved from the tokenizer in encode_chat).
constexpr std::string_view kTemplateTokens[] = {
    "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_response>", "</tool_response>"};

// Python str methods the template uses.
std::string lstrip_nl(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return std::string(s);
}
std::string rstrip_nl(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return std::string(s);
}
std::string strip_nl(std::string_view s) {
  return lstrip_nl(rstrip_nl(s));
}
bool starts_with(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}
// s.split(sep)[-1] and s.split(sep)[0]
std::string_view after_last(std::string_view s, std::string_view sep) {
  const size_t k = s.rfind(sep);
  return k == std::string_view::npos ? s : s.substr(k + sep.size());
}
std::string_view before_first(std::string_view s, std::string_view sep) {
  const size_t k = s.find(sep);
  return k == std::string_view::npos ? s : s.substr(0, k);
}

class Out {
 public:
  /// Template literal text: its special-token strings become special segments.
  void tmpl(std::string_view s) {
    while (!s.empty()) {
      size_t best = std::string_view::npos, len = 0;
      for (auto t : kTemplateTokens) {
        const size_t k = s.find(t);
        if (k != std::string_view::npos && (k < best || (k == best && t.size() > len))) {
          best = k;
          len = t.size();
        }
      }
      if (best == std::string_view::npos) {
        text(s);
        return;
      }
      text(s.substr(0, best));
      segs_.push_back({std::string(s.substr(best, len)), true});
      s.remove_prefix(best + len);
    }
  }
  /// Message text (never special).
  void text(std::string_view s) {
    if (s.empty()) return;
    if (!segs_.empty() && !segs_.back().special) {
      segs_.back().text += s;
    } else {
      segs_.push_back({std::string(s), false});
    }
  }
  std::vector<ChatSegment> take() { return std::move(segs_); }

 private:
  std::vector<ChatSegment> segs_;
};

void check_roles(std::span<const ChatMessage> messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& r = messages[i].role;
    FN_REQUIRE(r == "system" || r == "user" || r == "assistant" || r == "tool", Usage,
               "chat message {} has role '{}' (expected system, user, assistant or tool)", i, r);
  }
}

// reasoning_content / content of an assistant message, as the Qwen3 template derives them.
std::pair<std::string, std::string> assistant_parts(const ChatMessage& m) {
  std::string content = m.content, reasoning;
  if (m.reasoning_content) {
    reasoning = *m.reasoning_content;
  } else if (m.content.find("</think>") != std::string::npos) {
    // content = message.content.split('</think>')[-1].lstrip('\n')
    content = lstrip_nl(after_last(m.content, "</think>"));
    // reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
    const std::string head = rstrip_nl(before_first(m.content, "</think>"));
    reasoning = lstrip_nl(after_last(head, "<think>"));
  }
  return {content, reasoning};
}

void render_tool(Out& out, std::span<const ChatMessage> messages, size_t i) {
  // {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %} '<|im_start|>user'
  if (i == 0 || messages[i - 1].role != "tool") out.tmpl("<|im_start|>user");
  out.tmpl("\n<tool_response>\n");
  out.text(messages[i].content);
  out.tmpl("\n</tool_response>");
  if (i + 1 == messages.size() || messages[i + 1].role != "tool") out.tmpl("<|im_end|>\n");
}

std::vector<ChatSegment> render_qwen3(std::span<const ChatMessage> messages, const ChatOptions& o) {
  Out out;
  const size_t n = messages.size();
  // {%- if messages[0].role == 'system' %} '<|im_start|>system\n' + content + '<|im_end|>\n'
  if (n > 0 && messages[0].role == "system") {
    out.tmpl("<|im_start|>system\n");
    out.text(messages[0].content);
    out.tmpl("<|im_end|>\n");
  }
  // ns.last_query_index: the last user turn that is not a wrapped tool response.
  size_t last_query_index = n == 0 ? 0 : n - 1;
  for (size_t k = n; k-- > 0;) {
    const auto& m = messages[k];
    if (m.role == "user" &&
        !(starts_with(m.content, "<tool_response>") && ends_with(m.content, "</tool_response>"))) {
      last_query_index = k;
      break;
    }
  }
  const bool any_query = n > 0;
  for (size_t i = 0; i < n; ++i) {
    const auto& m = messages[i];
    if (m.role == "user" || (m.role == "system" && i != 0)) {
      out.tmpl("<|im_start|>" + m.role + "\n");
      out.text(m.content);
      out.tmpl("<|im_end|>\n");
    } else if (m.role == "assistant") {
      auto [content, reasoning] = assistant_parts(m);
      // {%- if loop.index0 > ns.last_query_index %}
      if (any_query && i > last_query_index && (i + 1 == n || !reasoning.empty())) {
        out.tmpl("<|im_start|>assistant\n<think>\n");
        out.text(strip_nl(reasoning));
        out.tmpl("\n</think>\n\n");
        out.text(lstrip_nl(content));
      } else {
        out.tmpl("<|im_start|>assistant\n");
        out.text(content);
      }
      out.tmpl("<|im_end|>\n");
    } else if (m.role == "tool") {
      render_tool(out, messages, i);
    }
  }
  if (o.add_generation_prompt) {
    out.tmpl("<|im_start|>assistant\n");
    if (o.enable_thinking.has_value() && !*o.enable_thinking) out.tmpl("<think>\n\n</think>\n\n");
  }
  return out.take();
}

std::vector<ChatSegment> render_qwen38(std::span<const ChatMessage> messages,
                                       const ChatOptions& o) {
  Out out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const auto& m = messages[i];
    if (m.role == "tool") {
      render_tool(out, messages, i);
      continue;
    }
    out.tmpl("<|im_start|>" + m.role + "\n");
    if (m.role == "assistant") {
      auto [content, reasoning] = assistant_parts(m);
      // preserve_thinking (default true): earlier turns keep their reasoning.
      if (!reasoning.empty()) {
        out.tmpl("<think>\n");
        out.text(strip_nl(reasoning));
        out.tmpl("\n</think>\n\n");
        out.text(lstrip_nl(content));
      } else {
        out.text(content);
      }
    } else {
      out.text(m.content);
    }
    out.tmpl("<|im_end|>\n");
  }
  if (o.add_generation_prompt) {
    out.tmpl("<|im_start|>assistant\n");
    out.tmpl(o.enable_thinking.value_or(true) ? "<think>\n" : "<think>\n\n</think>\n\n");
  }
  return out.take();
}

}  // namespace

std::vector<ChatMessage> chat_messages_from_json(const nlohmann::json& m) {
  FN_REQUIRE(m.is_array(), Format,
             "\"messages\" must be a list of {{\"role\", \"content\"}} objects, got {}",
             m.type_name());
  std::vector<ChatMessage> msgs;
  for (std::size_t i = 0; i < m.size(); ++i) {
    FN_REQUIRE(m[i].is_object(), Format, "\"messages\"[{}] must be an object, got {}", i,
               m[i].type_name());
    FN_REQUIRE(m[i].contains("role") && m[i]["role"].is_string(), Format,
               "\"messages\"[{}].role must be a string", i);
    const std::string role = m[i]["role"].get<std::string>();
    FN_REQUIRE(role == "system" || role == "user" || role == "assistant" || role == "tool", Format,
               "\"messages\"[{}].role \"{}\" is not one of system, user, assistant, tool", i, role);
    FN_REQUIRE(m[i].contains("content") && m[i]["content"].is_string(), Format,
               "\"messages\"[{}].content must be a string", i);
    ChatMessage msg{role, m[i]["content"].get<std::string>(), std::nullopt};
    if (m[i].contains("reasoning_content")) {
      FN_REQUIRE(m[i]["reasoning_content"].is_string(), Format,
                 "\"messages\"[{}].reasoning_content must be a string", i);
      msg.reasoning_content = m[i]["reasoning_content"].get<std::string>();
    }
    msgs.push_back(std::move(msg));
  }
  FN_REQUIRE(!msgs.empty(), Format, "\"messages\" is empty");
  return msgs;
}

std::vector<std::pair<std::string, std::size_t>> unknown_chat_message_fields(
    const nlohmann::json& m) {
  std::vector<std::pair<std::string, std::size_t>> out;
  if (!m.is_array()) return out;
  std::unordered_set<std::string> seen;
  for (std::size_t i = 0; i < m.size(); ++i) {
    if (!m[i].is_object()) continue;
    for (const auto& [key, value] : m[i].items()) {
      if (key == "role" || key == "content" || key == "reasoning_content") continue;
      if (seen.insert(key).second) out.emplace_back(key, i);
    }
  }
  return out;
}

ChatMode parse_chat_mode(std::string_view name) {
  if (name == "qwen3") return ChatMode::Qwen3;
  if (name == "qwen3.8") return ChatMode::Qwen38;
  FN_THROW(Usage, "unknown chat mode '{}' (expected qwen3 or qwen3.8)", name);
}

std::vector<ChatSegment> render_chat_segments(std::span<const ChatMessage> messages,
                                              const ChatOptions& options) {
  check_roles(messages);
  return options.mode == ChatMode::Qwen3 ? render_qwen3(messages, options)
                                         : render_qwen38(messages, options);
}

std::string render_chat(std::span<const ChatMessage> messages, const ChatOptions& options) {
  std::string text;
  for (const auto& s : render_chat_segments(messages, options)) text += s.text;
  return text;
}

std::vector<int32_t> encode_chat(const Tokenizer& tokenizer, std::span<const ChatMessage> messages,
                                 const ChatOptions& options) {
  std::vector<int32_t> ids;
  for (const auto& s : render_chat_segments(messages, options)) {
    if (s.special) {
      const auto id = tokenizer.token_to_id(s.text);
      FN_REQUIRE(id.has_value(), Format,
                 "the tokenizer has no token '{}', which the chat template needs", s.text);
      ids.push_back(*id);
    } else {
      const auto part = tokenizer.encode(s.text, EncodeMode::Plain);
      ids.insert(ids.end(), part.begin(), part.end());
    }
  }
  return ids;
}

ReasoningSplit split_reasoning(std::string_view generated) {
  ReasoningSplit r;
  const size_t k = generated.find("</think>");
  if (k == std::string_view::npos) {
    r.content = std::string(generated);
    return r;
  }
  r.has_reasoning = true;
  std::string_view head = generated.substr(0, k);
  if (const size_t o = head.find("<think>"); o != std::string_view::npos) head = head.substr(o + 7);
  r.reasoning = strip_nl(head);
  r.content = lstrip_nl(generated.substr(k + 8));
  return r;
}

}  // namespace fn
