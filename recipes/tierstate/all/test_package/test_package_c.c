/* The C API (option c_api): one AdamW step through libtierstate_c, from C. */
#include <tierstate/c.h>

#include <stdio.h>

int main(void)
{
  float w[1000], g[1000];
  for (int i = 0; i < 1000; ++i) { w[i] = 1.0f; g[i] = 0.25f; }
  tierstate_options o;
  tierstate_options_init(&o);
  tierstate_optimizer* opt = NULL;
  tierstate_status s = tierstate_create(&o, &opt);
  if (s == TIERSTATE_OK) { s = tierstate_add_tensor(opt, "w", w, 1000); }
  const void* grads[] = {g};
  if (s == TIERSTATE_OK) { s = tierstate_step(opt, grads, 1, 1.0, NULL); }
  int const ok = s == TIERSTATE_OK && w[0] < 1.0f && w[999] < 1.0f;
  printf("libtierstate_c %s (%s kernels): one AdamW step, weight 1 -> %g: %s%s\n", tierstate_version(),
         tierstate_arch() ? tierstate_arch() : "no", (double)w[0], ok ? "ok" : "failed ",
         s == TIERSTATE_OK ? "" : tierstate_last_error());
  tierstate_destroy(opt);
  return ok ? 0 : 1;
}
