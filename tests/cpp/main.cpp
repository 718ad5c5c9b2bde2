// Catch2's main, in its own translation unit so test files rebuild quickly.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
