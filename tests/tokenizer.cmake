# Tokenizer: HF goldens, unit/error tests, chat rendering, SentencePiece.
# NO_MPI: none of them starts MPI (fngen tokenize runs without it), so ASan unwinds fast.
find_package(ZLIB REQUIRED)
fn_add_test(NAME test_tokenizer_golden SOURCES test_tokenizer_golden.cpp LIBS fngen_tokenizer ZLIB::ZLIB
            LABEL cpu NO_MPI)
fn_add_test(NAME test_chat SOURCES test_chat.cpp LIBS fngen_tokenizer LABEL cpu NO_MPI)
fn_add_test(NAME test_tokenizer SOURCES test_tokenizer.cpp LIBS fngen_tokenizer LABEL cpu NO_MPI)
fn_add_test(NAME test_sentencepiece SOURCES test_sentencepiece.cpp LIBS fngen_tokenizer LABEL cpu NO_MPI)
fn_add_test(NAME test_tokenize_cli SOURCES test_tokenize_cli.cpp LIBS fngen_tokenizer LABEL cpu NO_MPI)
add_dependencies(test_tokenize_cli fngen)
