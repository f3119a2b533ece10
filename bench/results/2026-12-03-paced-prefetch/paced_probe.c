// Probe: random CHUNK-byte chunks of a 256 MiB buffer read line by line, WORK dependent FMAs per
// line; the prefetch cursor runs DIST lines ahead of the reads (in read order), issued in groups
// of G lines every G lines read (T0, or T1 where marked). "none": no prefetch; "hot": 64 chunks
// reused (cache-resident). Best of 5 runs per variant, ns per line.
//   gcc -O2 -mavx512f -o paced_probe paced_probe.c && ./paced_probe CHUNK WORK
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
// consume random CHUNK-byte chunks; prefetch cursor runs DIST lines ahead (in consumption order), issued in groups of G every G lines.
int main(int argc,char**argv){
  size_t total=(size_t)256<<20; int chunk=atoi(argv[1]); int work=atoi(argv[2]);
  char*buf=aligned_alloc(2<<20,total); memset(buf,1,total);
  size_t nch=total/chunk; uint32_t*order=malloc(nch*4); for(size_t i=0;i<nch;i++)order[i]=i;
  srand(1); for(size_t i=nch-1;i>0;i--){size_t j=rand()%(i+1);uint32_t t=order[i];order[i]=order[j];order[j]=t;}
  int lines=chunk/64; size_t nl=nch*lines;
  __m512 acc[8]; for(int i=0;i<8;i++)acc[i]=_mm512_set1_ps(0.f);
  const __m512 m=_mm512_set1_ps(1.0001f);
  int cfg[][3]={{0,0,0},{-1,0,0},{256,8,0},{256,32,0},{256,128,0},{512,8,0},{1024,8,0},{512,32,0},{512,8,1},{512,32,1}};
  double best[10]; for(int k=0;k<10;k++)best[k]=1e9;
  for(int rep=0;rep<5;rep++) for(int k=0;k<10;k++){
    int dist=cfg[k][0], g=cfg[k][1], t1=cfg[k][2];
    double t0=now();
    size_t pc=dist>0?dist:0;
    for(size_t L=0;L<nl;L++){
      size_t c=L/lines; int l=L%lines;
      size_t cc = dist<0 ? c%64 : c;
      const char*base=buf+(size_t)order[cc]*chunk+l*64;
      if(dist>0 && L%g==0) for(int q=0;q<g && pc<nl;q++,pc++){ const char*a=buf+(size_t)order[pc/lines]*chunk+(pc%lines)*64; if(t1)_mm_prefetch(a,_MM_HINT_T1); else _mm_prefetch(a,_MM_HINT_T0);}
      __m512 v=_mm512_load_ps((const float*)base);
      for(int w=0;w<work;w++) for(int i=0;i<8;i++) acc[i]=_mm512_fmadd_ps(acc[i],m,v);
    }
    double t=now()-t0; if(t<best[k])best[k]=t;
  }
  const char*names[]={"none","hot","d256 g8","d256 g32","d256 g128","d512 g8","d1024 g8","d512 g32","d512 g8 T1","d512 g32 T1"};
  for(int k=0;k<10;k++) printf("chunk %d work %d %-12s %.2f ns/line\n",chunk,work,names[k],best[k]/nl*1e9);
  float s=0; for(int i=0;i<8;i++) s+=_mm512_reduce_add_ps(acc[i]); if(s==1.234f)printf("x");
}
