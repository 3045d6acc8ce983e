# Tokenizer (issue 3): HF goldens, unit/error tests, chat rendering, SentencePiece.
find_package(ZLIB REQUIRED)
fn_add_test(NAME test_tokenizer_golden SOURCES test_tokenizer_golden.cpp LIBS fngen_tokenizer ZLIB::ZLIB LABEL cpu)
fn_add_test(NAME test_chat SOURCES test_chat.cpp LIBS fngen_tokenizer LABEL cpu)
fn_add_test(NAME test_tokenizer SOURCES test_tokenizer.cpp LIBS fngen_tokenizer LABEL cpu)
fn_add_test(NAME test_sentencepiece SOURCES test_sentencepiece.cpp LIBS fngen_tokenizer LABEL cpu)
fn_add_test(NAME test_tokenize_cli SOURCES test_tokenize_cli.cpp LIBS fngen_tokenizer LABEL cpu)
add_dependencies(test_tokenize_cli fngen)
