# systemd's own quoting for one word of ExecStart: a word stays bare when it holds no special character; otherwise it
# is double-quoted with backslash escapes. `%` (specifiers) and `$` (variable expansion) are doubled either way.
arg:
let
  literal = builtins.replaceStrings [ "%" "$" ] [ "%%" "$$" ] arg;
in
if builtins.match "[A-Za-z0-9_./:=@+,-]+" arg != null then
  literal
else
  "\"" + builtins.replaceStrings [ "\\" "\"" ] [ "\\\\" "\\\"" ] literal + "\""
