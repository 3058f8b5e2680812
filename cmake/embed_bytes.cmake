# embed_bytes(FILE NAME BODY LEN): appends to the variable named by BODY the C definition
#   static const unsigned char NAME[] = {<FILE's bytes>, 0};
# and sets the variable named by LEN to the file's size in bytes (the 0 is not counted).
# For the build-time scripts that embed files into binaries (migrations, the dashboard).
# (Parameter names are prefixed so that they never hide the caller's variables.)
function(embed_bytes eb_file eb_name eb_body eb_len)
  file(READ ${eb_file} eb_hex HEX)
  string(LENGTH "${eb_hex}" eb_hexlen)
  math(EXPR eb_n "${eb_hexlen} / 2")
  string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," eb_bytes "${eb_hex}")
  set(${eb_body} "${${eb_body}}static const unsigned char ${eb_name}[] = {${eb_bytes}0};\n" PARENT_SCOPE)
  set(${eb_len} ${eb_n} PARENT_SCOPE)
endfunction()
