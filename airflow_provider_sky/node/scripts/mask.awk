
BEGIN { while ((getline s < "/dev/fd/3") > 0) if (s != "") v[++n] = s; close("/dev/fd/3") }
{
  for (i = 1; i <= n; i++) if (index($0, v[i])) break
  if (i > n) { print; fflush(); next }
  t = $0; o = ""
  for (;;) {
    b = 0
    for (i = 1; i <= n; i++) if ((p = index(t, v[i])) > 0 && (b == 0 || p < b)) { b = p; l = length(v[i]) }
    if (b == 0) break
    o = o substr(t, 1, b - 1) "***"; t = substr(t, b + l)
  }
  print o t; fflush()
}
